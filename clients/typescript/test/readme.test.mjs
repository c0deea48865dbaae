// The README's example is examples/quickstart.mjs, and it runs against the gateway.
import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { execFileSync } from "node:child_process";
import path from "node:path";
import { PACKAGE, liveSkip, requireLive } from "./support.mjs";

const example = path.join(PACKAGE, "examples", "quickstart.mjs");

test("the README shows the example file", () => {
  const readme = readFileSync(path.join(PACKAGE, "README.md"), "utf8");
  const code = readFileSync(example, "utf8");
  assert.ok(readme.includes("```js\n" + code + "```"), "README.md's example differs from examples/quickstart.mjs");
});

test("the example runs", { skip: liveSkip }, () => {
  const { baseUrl, apiKey } = requireLive();
  const env = { ...process.env, INTAKE_BASE_URL: baseUrl, INTAKE_API_KEY: apiKey };
  const [first, second] = [1, 2].map(() => execFileSync(process.execPath, [example], { env, encoding: "utf8" }));
  console.log(first);
  assert.ok(["created", "unchanged"].includes(first.split("\n")[1]), first);
  assert.equal(second.split("\n")[1], "unchanged", second);
});
