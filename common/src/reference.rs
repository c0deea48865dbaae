//! The configuration reference (`docs/configuration.md`) rendered from the programs' own clap
//! definitions, so that it cannot drift from them. Each program prints its part when run with
//! `--config-reference` as its only argument; `deploy/config-reference.sh` assembles the file.

use clap::{Arg, ArgAction, Command, CommandFactory};
use std::fmt::Write;

/// The argument that makes a program print its reference instead of running.
pub const FLAG: &str = "--config-reference";

/// Prints the reference of `C` and exits when the program was run with [`FLAG`] alone; does
/// nothing otherwise. Called first thing in `main`, before the command line is parsed (the
/// programs' required settings would refuse a bare flag).
pub fn print_if_asked<C: CommandFactory>() {
    let mut args = std::env::args_os().skip(1);
    if args.next().is_some_and(|arg| arg == FLAG) && args.next().is_none() {
        print!("{}", markdown(&C::command()));
        std::process::exit(0);
    }
}

/// One section per command and subcommand that takes arguments: flag, environment variable,
/// default and help text of each.
pub fn markdown(command: &Command) -> String {
    let mut out = String::new();
    render(command, command.get_name(), &mut out);
    out
}

fn render(command: &Command, path: &str, out: &mut String) {
    let args: Vec<&Arg> = command
        .get_arguments()
        .filter(|arg| !arg.is_hide_set() && !matches!(arg.get_id().as_str(), "help" | "version"))
        .collect();
    if !args.is_empty() {
        let _ = writeln!(out, "### `{path}`\n");
        if let Some(about) = command.get_long_about().or(command.get_about()) {
            let about = one_line(&about.to_string());
            let stop = if about.ends_with('.') { "" } else { "." };
            let _ = writeln!(out, "{about}{stop}\n");
        }
        out.push_str("| flag | variable | default | description |\n|---|---|---|---|\n");
        for arg in args {
            let _ = writeln!(out, "| {} | {} | {} | {} |", flag(arg), variable(arg), default(arg), description(arg));
        }
        out.push('\n');
    }
    for sub in command.get_subcommands().filter(|sub| !sub.is_hide_set()) {
        render(sub, &format!("{path} {}", sub.get_name()), out);
    }
}

fn flag(arg: &Arg) -> String {
    let value = arg
        .get_value_names()
        .map(|names| names.iter().map(|n| format!("<{n}>")).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|| format!("<{}>", arg.get_id().as_str().to_uppercase()));
    let text = match arg.get_long() {
        Some(long) if takes_value(arg) => format!("--{long} {value}"),
        Some(long) => format!("--{long}"),
        None => value,
    };
    code(&text)
}

fn takes_value(arg: &Arg) -> bool {
    !matches!(arg.get_action(), ArgAction::SetTrue | ArgAction::SetFalse | ArgAction::Count)
}

fn variable(arg: &Arg) -> String {
    arg.get_env().map(|env| code(&env.to_string_lossy())).unwrap_or_default()
}

fn default(arg: &Arg) -> String {
    let defaults: Vec<String> = arg.get_default_values().iter().map(|v| v.to_string_lossy().into_owned()).collect();
    if arg.is_required_set() {
        "required".to_owned()
    } else if defaults.is_empty() || !takes_value(arg) {
        String::new()
    } else {
        code(&defaults.join(","))
    }
}

fn description(arg: &Arg) -> String {
    let mut sentences = Vec::new();
    if let Some(help) = arg.get_long_help().or(arg.get_help()) {
        sentences.push(one_line(&help.to_string()));
    }
    let possible: Vec<String> =
        arg.get_possible_values().iter().filter(|v| !v.is_hide_set()).map(|v| code(v.get_name())).collect();
    if takes_value(arg) && !possible.is_empty() {
        sentences.push(format!("One of {}", possible.join(", ")));
    }
    if arg.get_num_args().is_some_and(|n| n.max_values() > 1) || matches!(arg.get_action(), ArgAction::Append) {
        sentences.push("May be repeated".to_owned());
    }
    // clap drops the full stop of a one-line help; every sentence gets one back.
    let sentences: Vec<String> = sentences
        .into_iter()
        .filter(|s| !s.is_empty())
        .map(|s| if s.ends_with('.') { s } else { format!("{s}.") })
        .collect();
    sentences.join(" ").replace('|', "\\|")
}

/// Help text over several lines becomes one table cell.
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn code(text: &str) -> String {
    format!("`{}`", text.replace('|', "\\|"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Parser, Subcommand};

    #[derive(Parser)]
    #[command(name = "demo")]
    struct Demo {
        /// Where to listen.
        #[arg(long, env = "DEMO_LISTEN", default_value = "127.0.0.1:1")]
        listen: String,
        /// Talk | more.
        #[arg(long, env = "DEMO_VERBOSE")]
        verbose: bool,
        #[arg(long, value_enum, default_value = "a")]
        mode: Mode,
        #[command(subcommand)]
        command: Sub,
    }

    #[derive(Clone, clap::ValueEnum)]
    enum Mode {
        A,
        B,
    }

    #[derive(Subcommand)]
    enum Sub {
        /// Runs it.
        Run {
            /// The input.
            input: String,
            #[arg(long, value_delimiter = ',')]
            tag: Vec<String>,
        },
        Idle,
    }

    #[test]
    fn every_flag_has_its_variable_default_and_help() {
        let text = markdown(&Demo::command());
        assert!(text.contains("### `demo`\n"), "{text}");
        assert!(text.contains("| `--listen <LISTEN>` | `DEMO_LISTEN` | `127.0.0.1:1` | Where to listen. |"), "{text}");
        assert!(text.contains("| `--verbose` | `DEMO_VERBOSE` |  | Talk \\| more. |"), "{text}");
        assert!(text.contains("| `--mode <MODE>` |  | `a` | One of `a`, `b`. |"), "{text}");
        assert!(text.contains("### `demo run`\n\nRuns it.\n"), "{text}");
        assert!(text.contains("| `<INPUT>` |  | required | The input. |"), "{text}");
        assert!(text.contains("| `--tag <TAG>` |  |  | May be repeated. |"), "{text}");
        assert!(!text.contains("demo idle"), "a subcommand without arguments has no section: {text}");
        assert!(!text.contains("--help"), "{text}");
    }
}
