// The README's TypeScript examples compile under `tsc --strict` against the built declarations
// (dist/src/index.d.ts, what an installed package ships), and a mistyped response field does not.
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import os from "node:os";
import path from "node:path";
import { test } from "node:test";
import { PKG } from "./support.js";

/** What the examples use without declaring it. */
const AMBIENT = `
declare const client: import("@contextsvc/client").ContextClient;
declare const ContextClient: typeof import("@contextsvc/client").ContextClient;
declare const pngBytes: Uint8Array;
declare const sessionId: string;
declare const lastSeen: number;
declare const signal: AbortSignal;
declare const ca: string, cert: string, key: string;
`;

function snippets(): string[] {
  const readme = readFileSync(path.join(PKG, "README.md"), "utf8");
  return [...readme.matchAll(/^```ts\n([\s\S]*?)^```$/gm)].map((m) => m[1]!);
}

/** Type-checks each snippet as its own ES module; returns tsc's exit status and output. */
function typecheck(sources: string[]): { status: number | null; output: string } {
  const dir = mkdtempSync(path.join(os.tmpdir(), "contextsvc-readme-"));
  try {
    const files = sources.map((src, i) => {
      const file = path.join(dir, `snippet${i + 1}.mts`);
      writeFileSync(file, `export {};\n${src}`);
      return file;
    });
    writeFileSync(path.join(dir, "ambient.d.ts"), AMBIENT);
    const tsconfig = {
      compilerOptions: {
        strict: true,
        noEmit: true,
        target: "ES2022",
        module: "NodeNext",
        moduleResolution: "NodeNext",
        lib: ["ES2022"],
        types: ["node"],
        typeRoots: [path.join(PKG, "node_modules", "@types")],
        skipLibCheck: true,
        paths: { "@contextsvc/client": [path.join(PKG, "dist", "src", "index.d.ts")] },
      },
      files: [path.join(dir, "ambient.d.ts"), ...files],
    };
    writeFileSync(path.join(dir, "tsconfig.json"), JSON.stringify(tsconfig, null, 1));
    const tsc = path.join(PKG, "node_modules", "typescript", "bin", "tsc");
    const run = spawnSync(process.execPath, [tsc, "-p", path.join(dir, "tsconfig.json"), "--noEmit", "--strict"], {
      cwd: dir,
      encoding: "utf8",
    });
    return { status: run.status, output: `${run.stdout}${run.stderr}`.replaceAll(dir, "<snippets>") };
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}

test("the README's TypeScript examples compile under tsc --strict", () => {
  const found = snippets();
  assert.ok(found.length >= 4, `only ${found.length} ts blocks in README.md`);
  assert.ok(found.some((s) => s.includes("view.messages.map((m) => m.role)")), "the First call example");
  const { status, output } = typecheck(found);
  assert.equal(status, 0, output);
});

test("a mistyped response field is a compile error", () => {
  const { status, output } = typecheck([
    `const s = await client.createSession({ name: "demo" });\nconsole.log(s.idd);`,
    `const v = await client.buildContext("s");\nconst roles: string[] = v.messages.map((m) => m.rol);`,
  ]);
  assert.notEqual(status, 0);
  assert.match(output, /snippet1\.mts\(\d+,\d+\): error TS2339: Property 'idd' does not exist on type 'Session'/);
  assert.match(output, /snippet2\.mts\(\d+,\d+\): error TS2551: Property 'rol' does not exist on type 'Message'/);
});
