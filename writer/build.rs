// `sqlx::migrate!` embeds the migrations when the writer compiles; without this, a migration
// added without a change to the writer's own sources would be missing from the next build.
fn main() {
    println!("cargo:rerun-if-changed=../migrations");
}
