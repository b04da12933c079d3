// Test support: a real `contextsvc serve` process and a loopback TCP proxy a test can cut.
import { spawn, type ChildProcess } from "node:child_process";
import net from "node:net";
import path from "node:path";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
/** The repository root (dist/test -> clients/typescript -> repo). */
export const REPO = path.resolve(here, "..", "..", "..", "..");

export interface Server {
  address: string;
  stop(): void;
}

/** The package root (dist/test -> clients/typescript). */
export const PKG = path.resolve(here, "..", "..");

export interface ServerOptions {
  /** Extra `serve` flags, e.g. `["--tls-cert", file, "--tls-key", file]`. */
  args?: string[];
  /** Extra environment, e.g. `{ CONTEXTSVC_QUOTAS__STREAMS_PER_USER: "2" }`. */
  env?: Record<string, string>;
}

/** Starts `python3 -m contextsvc serve --store memory` on a free port; resolves once it prints its address. */
export function startServer(options: ServerOptions = {}): Promise<Server> {
  const python = process.env.PYTHON ?? "python3";
  const args = ["-m", "contextsvc", "serve", "--listen", "127.0.0.1:0", "--store", "memory", ...(options.args ?? [])];
  const proc: ChildProcess = spawn(python, args, {
    cwd: REPO,
    env: { ...process.env, ...options.env },
    stdio: ["ignore", "pipe", "ignore"],
  });
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => {
      proc.kill("SIGKILL");
      reject(new Error("server did not start within 30 s"));
    }, 30_000);
    let buf = "";
    proc.stdout!.on("data", (chunk: Buffer) => {
      buf += chunk.toString();
      const m = /contextsvc listening on (\S+):(\d+)/.exec(buf);
      if (m) {
        clearTimeout(timer);
        resolve({ address: `${m[1]}:${m[2]}`, stop: () => proc.kill("SIGKILL") });
      }
    });
    proc.on("exit", (code) => {
      clearTimeout(timer);
      reject(new Error(`server exited with ${code}`));
    });
  });
}

/** Forwards 127.0.0.1:<port> to a target; `drop()` cuts live connections, `stopListening()` refuses new ones. */
export class TcpProxy {
  port = 0;
  private server: net.Server | undefined;
  private sockets = new Set<net.Socket>();
  constructor(private readonly target: string) {}

  get address(): string {
    return `127.0.0.1:${this.port}`;
  }

  async start(): Promise<this> {
    const [host, port] = [this.target.slice(0, this.target.lastIndexOf(":")), Number(this.target.slice(this.target.lastIndexOf(":") + 1))];
    this.server = net.createServer((client) => {
      const upstream = net.connect(port, host);
      for (const s of [client, upstream]) {
        this.sockets.add(s);
        s.on("close", () => this.sockets.delete(s));
        s.on("error", () => {
          client.destroy();
          upstream.destroy();
        });
      }
      client.pipe(upstream);
      upstream.pipe(client);
    });
    await new Promise<void>((resolve) => this.server!.listen(this.port, "127.0.0.1", resolve));
    this.port = (this.server.address() as net.AddressInfo).port;
    return this;
  }

  drop(): void {
    for (const s of this.sockets) s.resetAndDestroy();
    this.sockets.clear();
  }

  async stopListening(): Promise<void> {
    const srv = this.server;
    this.server = undefined;
    this.drop();
    if (srv) await new Promise<void>((resolve) => srv.close(() => resolve()));
  }
}

export async function until(cond: () => boolean, limitMs = 10_000): Promise<void> {
  const end = Date.now() + limitMs;
  while (!cond()) {
    if (Date.now() > end) throw new Error("condition not reached");
    await new Promise((r) => setTimeout(r, 20));
  }
}
