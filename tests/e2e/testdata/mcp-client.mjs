// mcp-client.mjs drives an MCP server with the official TypeScript SDK's
// client (@modelcontextprotocol/sdk), for the end-to-end test TestMCP.
//
//   node mcp-client.mjs stdio CALLS COMMAND [ARGS...]   spawn the server
//   node mcp-client.mjs http CALLS URL TOKEN             streamable HTTP
//
// CALLS is a JSON array of {"tool": NAME, "args": {...}} (with
// "progress": true, asking for progress notifications), or {"list": true}
// for tools/list. It prints one JSON line per call: tools/list's tool
// names, or a tool's result (isError, content, structuredContent, and the
// progress notifications' messages). A protocol error ends it with exit
// status 1.
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

const [mode, callsJSON, ...rest] = process.argv.slice(2);
const calls = JSON.parse(callsJSON);
let transport;
if (mode === "stdio") {
	// The SDK passes the server only a few variables unless told: the
	// test's state directory (CAPSA_STATE) must reach it.
	transport = new StdioClientTransport({ command: rest[0], args: rest.slice(1), env: { ...process.env }, stderr: "inherit" });
} else if (mode === "http") {
	transport = new StreamableHTTPClientTransport(new URL(rest[0]), {
		requestInit: { headers: { Authorization: `Bearer ${rest[1]}` } },
	});
} else {
	console.error(`mcp-client: unknown mode ${mode}`);
	process.exit(2);
}
const client = new Client({ name: "capsa-e2e", version: "1.0.0" });
// A sandbox boots in seconds, but the nested test host is slow: far more
// than the SDK's 60 s default.
const opts = { timeout: 300_000 };
try {
	await client.connect(transport, opts);
	const v = client.getServerVersion();
	console.log(JSON.stringify({ server: v }));
	for (const c of calls) {
		if (c.list) {
			const r = await client.listTools({}, opts);
			console.log(JSON.stringify({ tools: r.tools.map((t) => t.name) }));
			continue;
		}
		// With "progress", the call asks for progress notifications (the
		// SDK sends a progress token) and the line lists their messages.
		const progress = [];
		const callOpts = c.progress ? { ...opts, onprogress: (p) => progress.push(p.message) } : opts;
		const r = await client.callTool({ name: c.tool, arguments: c.args }, undefined, callOpts);
		console.log(JSON.stringify({ tool: c.tool, isError: !!r.isError, content: r.content, structuredContent: r.structuredContent, progress }));
	}
	await client.close();
} catch (e) {
	console.error(`mcp-client: ${e?.stack ?? e}`);
	process.exit(1);
}
