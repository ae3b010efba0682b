// e2b-client.mjs MODE [ARG]: drives `capsa serve` with E2B's official JS
// SDK (npm e2b, from the mcp-client bundle), as an agent would, and prints
// one line per step: "ok STEP [detail]" or "FAIL STEP: why". Every step
// runs even if one before it failed; the exit code is 1 if any failed.
// The environment gives E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY and
// TEMPLATE (an image reference).
//
// Modes:
//   main         everything below on new sandboxes; leaves one running,
//                printed as "keep ID", for after-restart
//   after-restart ID  the server was restarted: reach sandbox ID again
//   old          the same basics with the SDK from before /v2 (e2b-old)
//   bench        reads commands on stdin, one a line, and answers each
//                with "ms N" (or "error: why"): first-output TEMPLATE
//                (create, then a command's first output), concurrent
//                TEMPLATE N (N of those at once), keep TEMPLATE (a
//                sandbox for run-true; answers "id ID"), run-true (a
//                commands.run('true') on it)
import { createHash, randomBytes } from 'node:crypto'
import http from 'node:http'

const mode = process.argv[2]
const sdk = await import(mode === 'old' ? 'e2b-old' : 'e2b')
const { Sandbox, CommandExitError, TimeoutError, NotFoundError, AuthenticationError } = sdk
const template = process.env.TEMPLATE
let failed = 0

// step runs one check and prints its result and how long it took (where
// the test's time goes).
async function step(name, fn) {
  const start = Date.now()
  const took = () => `(${((Date.now() - start) / 1000).toFixed(1)} s)`
  try {
    const detail = await fn()
    console.log(`ok ${name}${detail === undefined ? '' : ' ' + JSON.stringify(detail)} ${took()}`)
  } catch (e) {
    failed++
    const stderr = e?.stderr ? ` (stderr: ${e.stderr.slice(-500)})` : ''
    console.log(`FAIL ${name}: ${e?.constructor?.name}: ${e?.message ?? e}${stderr}`.replaceAll('\n', ' | ') + ` ${took()}`)
  }
}

function check(cond, msg) {
  if (!cond) throw new Error(msg)
}

function eq(got, want, what) {
  check(JSON.stringify(got) === JSON.stringify(want), `${what}: got ${JSON.stringify(got)}, want ${JSON.stringify(want)}`)
}

async function expectThrow(fn, cls, what) {
  try {
    await fn()
  } catch (e) {
    check(e instanceof cls, `${what}: threw ${e?.constructor?.name} (${e?.message}), want ${cls.name}`)
    return e
  }
  throw new Error(`${what}: did not throw, want ${cls.name}`)
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms))
const sha = (b) => createHash('sha256').update(b).digest('hex')

async function basics(sbx) {
  await step('commands.run stdout and stderr', async () => {
    const outs = [], errs = []
    const r = await sbx.commands.run('echo out; echo err >&2', { onStdout: (d) => outs.push(d), onStderr: (d) => errs.push(d) })
    eq([r.exitCode, r.stdout, r.stderr], [0, 'out\n', 'err\n'], 'result')
    eq([outs.join(''), errs.join('')], ['out\n', 'err\n'], 'callbacks')
  })
  await step('commands.run envs, cwd and user', async () => {
    const r = await sbx.commands.run('echo "$A $FROM_CREATE $(pwd) $(id -un) $HOME"', { envs: { A: 'b' }, cwd: '/tmp' })
    eq(r.stdout, 'b 1 /tmp user /home/user\n', 'stdout')
    const root = await sbx.commands.run('id -u', { user: 'root' })
    eq(root.stdout, '0\n', 'as root')
  })
  await step('a failing command throws CommandExitError', async () => {
    const e = await expectThrow(() => sbx.commands.run('echo partial; exit 3'), CommandExitError, 'exit 3')
    eq([e.exitCode, e.stdout], [3, 'partial\n'], 'the error')
  })
}

if (mode === 'main') {
  const run = randomBytes(4).toString('hex')
  const meta = { suite: 'capsa', run }
  let sbx
  await step('Sandbox.create', async () => {
    sbx = await Sandbox.create(template, { timeoutMs: 600_000, metadata: meta, envs: { FROM_CREATE: '1' } })
    return sbx.sandboxId
  })
  if (!sbx) {
    process.exit(1)
  }
  await basics(sbx)

  await step('background command: list, sendStdin, wait', async () => {
    const h = await sbx.commands.run('read line; echo got:$line', { background: true, stdin: true })
    const list = await sbx.commands.list()
    check(list.some((p) => p.pid === h.pid), `commands.list has no pid ${h.pid}: ${JSON.stringify(list)}`)
    await sbx.commands.sendStdin(h.pid, 'hello\n')
    const r = await h.wait()
    eq(r.stdout, 'got:hello\n', 'stdout')
    const c = await sbx.commands.run('cat; echo end', { background: true, stdin: true })
    await sbx.commands.sendStdin(c.pid, 'abc')
    await sbx.commands.closeStdin(c.pid)
    eq((await c.wait()).stdout, 'abcend\n', 'stdin closed')
  })
  await step('connect to a command from a second client, then kill one', async () => {
    const h = await sbx.commands.run('for i in 1 2 3; do echo tick$i; sleep 1; done', { background: true })
    const other = await Sandbox.connect(sbx.sandboxId)
    const seen = []
    const h2 = await other.commands.connect(h.pid, { onStdout: (d) => seen.push(d) })
    const r = await h2.wait()
    check(r.stdout.includes('tick3'), `the second client's stdout ${JSON.stringify(r.stdout)} lacks tick3`)
    const long = await sbx.commands.run('sleep 1000', { background: true })
    eq(await sbx.commands.kill(long.pid), true, 'kill')
    await expectThrow(() => long.wait(), CommandExitError, 'the killed command')
    const list = await sbx.commands.list()
    check(!list.some((p) => p.pid === long.pid), 'the killed command is still listed')
    eq(await sbx.commands.kill(999999), false, 'killing no such process')
  })
  await step('pty: create, input, resize', async () => {
    let out = ''
    const pty = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => { out += new TextDecoder().decode(d) }, timeoutMs: 60_000 })
    await sbx.pty.sendInput(pty.pid, new TextEncoder().encode('stty size\n'))
    for (let i = 0; i < 100 && !out.includes('24 80'); i++) await sleep(100)
    check(out.includes('24 80'), `stty size before the resize: ${JSON.stringify(out.slice(-200))}`)
    await sbx.pty.resize(pty.pid, { cols: 100, rows: 30 })
    await sbx.pty.sendInput(pty.pid, new TextEncoder().encode('stty size; exit\n'))
    await pty.wait()
    check(out.includes('30 100'), `stty size after the resize: ${JSON.stringify(out.slice(-200))}`)
  })
  await step('files: text, binary and 20 MiB written and read back', async () => {
    const info = await sbx.files.write('notes/a.txt', 'héllo\n')
    eq([info.path, info.name], ['/home/user/notes/a.txt', 'a.txt'], 'write info')
    eq(await sbx.files.read('notes/a.txt'), 'héllo\n', 'text')
    const bin = new Uint8Array(256).map((_, i) => i)
    await sbx.files.write('/tmp/bin', bin.buffer)
    eq(sha(await sbx.files.read('/tmp/bin', { format: 'bytes' })), sha(bin), 'binary')
    const big = randomBytes(20 << 20)
    await sbx.files.write('/tmp/big', new Blob([big]))
    const back = await sbx.files.read('/tmp/big', { format: 'bytes' })
    eq([back.length, sha(back)], [big.length, sha(big)], '20 MiB')
    const r = await sbx.commands.run('stat -c %U:%s notes/a.txt; sha256sum /tmp/big')
    eq(r.stdout, `user:7\n${sha(big)}  /tmp/big\n`, 'as the guest sees them')
    // A stream goes up as application/octet-stream, and gzipped if asked.
    await sbx.files.write('/tmp/streamed', new Blob([big.subarray(0, 1 << 20)]).stream())
    await sbx.files.write('/tmp/zipped', 'zipped text\n', { gzip: true })
    eq(sha(await sbx.files.read('/tmp/streamed', { format: 'bytes' })), sha(big.subarray(0, 1 << 20)), 'streamed')
    eq(await sbx.files.read('/tmp/zipped', { gzip: true }), 'zipped text\n', 'gzipped')
  })
  await step('files: list, exists, makeDir, rename, remove, getInfo', async () => {
    await sbx.files.write('tree/sub/f.txt', 'x')
    const names = (await sbx.files.list('tree', { depth: 2 })).map((e) => `${e.type}:${e.path}`).sort()
    eq(names, ['dir:/home/user/tree/sub', 'file:/home/user/tree/sub/f.txt'], 'list depth 2')
    eq((await sbx.files.list('tree')).length, 1, 'list depth 1')
    eq([await sbx.files.exists('tree/sub/f.txt'), await sbx.files.exists('tree/nope')], [true, false], 'exists')
    eq([await sbx.files.makeDir('made/deep'), await sbx.files.makeDir('made/deep')], [true, false], 'makeDir twice')
    const moved = await sbx.files.rename('tree/sub/f.txt', 'made/deep/g.txt')
    eq(moved.path, '/home/user/made/deep/g.txt', 'rename')
    const gi = await sbx.files.getInfo('made/deep/g.txt')
    eq([gi.type, gi.size, gi.owner, gi.permissions], ['file', 1, 'user', '-rw-r--r--'], 'getInfo')
    await sbx.files.remove('made')
    eq(await sbx.files.exists('made'), false, 'removed')
    await expectThrow(() => sbx.files.read('made/deep/g.txt'), NotFoundError, 'reading a removed file')
  })
  await step('files: metadata kept with a file; entries in watch events', async () => {
    const canon = (o) => JSON.stringify(Object.fromEntries(Object.entries(o ?? {}).sort()))
    const want = canon({ owner: 'agent', 'build-id': '42' })
    const info = await sbx.files.write('meta.txt', 'm', { metadata: { owner: 'agent', 'build-id': '42' } })
    eq(canon(info.metadata), want, 'the write')
    eq(canon((await sbx.files.getInfo('meta.txt')).metadata), want, 'getInfo')
    eq(canon((await sbx.files.list('.')).find((e) => e.name === 'meta.txt')?.metadata), want, 'list')
    eq((await sbx.files.getInfo('notes/a.txt')).metadata, undefined, 'a file without')
    const events = []
    const w = await sbx.files.watchDir('/home/user', (e) => events.push(e), { includeEntry: true })
    await sbx.commands.run('echo abc > entry.txt')
    const has = () => events.find((e) => e.name === 'entry.txt' && e.entry)
    for (let i = 0; i < 100 && !has(); i++) await sleep(100)
    await w.stop()
    const ev = has()
    check(ev && ev.entry.path === '/home/user/entry.txt' && ev.entry.type === 'file' && ev.entry.owner === 'user', `events: ${JSON.stringify(events)}`)
  })
  await step('watchDir sees a file a command makes', async () => {
    const events = []
    const w = await sbx.files.watchDir('/home/user', (e) => events.push(e), { recursive: true })
    await sbx.commands.run('mkdir -p w && echo x > w/watched.txt')
    for (let i = 0; i < 100 && !events.some((e) => e.name === 'w/watched.txt'); i++) await sleep(100)
    await w.stop()
    check(events.some((e) => e.name === 'w/watched.txt' && e.type === 'create'), `events: ${JSON.stringify(events)}`)
  })
  await step('getHost: an HTTP server in the guest, through the server', async () => {
    await sbx.files.write('site/index.html', 'hello from the guest\n')
    const srv = await sbx.commands.run('cd site && exec python3 -m http.server 8000 --bind 127.0.0.1', { background: true, timeoutMs: 0 })
    let body
    for (let i = 0; i < 150 && body === undefined; i++) {
      const r = await fetch(`${process.env.E2B_API_URL}/index.html`, { headers: { 'E2b-Sandbox-Id': sbx.sandboxId, 'E2b-Sandbox-Port': '8000' } })
      if (r.status === 200) body = await r.text()
      else await sleep(200)
    }
    eq(body, 'hello from the guest\n', 'through E2b-Sandbox-Port')
    // By the host name getHost gives, as a browser would send it.
    const host = sbx.getHost(8000)
    check(host.startsWith(`8000-${sbx.sandboxId}.`), `getHost(8000) = ${host}`)
    const u = new URL(process.env.E2B_API_URL)
    const [status, text] = await new Promise((resolve, reject) => {
      const req = http.get({ host: u.hostname, port: u.port, path: '/index.html', headers: { Host: host } }, (r) => {
        let b = ''
        r.on('data', (d) => { b += d })
        r.on('end', () => resolve([r.statusCode, b]))
      })
      req.on('error', reject)
    })
    eq([status, text], [200, 'hello from the guest\n'], 'through the host name')
    const closed = await fetch(`${process.env.E2B_API_URL}/`, { headers: { 'E2b-Sandbox-Id': sbx.sandboxId, 'E2b-Sandbox-Port': '8001' } })
    eq(closed.status, 502, 'a port nothing listens on')
    await sbx.commands.kill(srv.pid)
  })
  await step('a pre-booted template: restored, its start command already serving', async () => {
    const w = await Sandbox.create('web', { timeoutMs: 60_000, envs: { FROM_CREATE: '2' } })
    const r = await fetch(`${process.env.E2B_API_URL}/index.html`, { headers: { 'E2b-Sandbox-Id': w.sandboxId, 'E2b-Sandbox-Port': '8002' } })
    eq([r.status, await r.text()], [200, 'prebooted\n'], 'its server, at once')
    eq((await w.commands.run('echo $FROM_CREATE $TEMPLATE_VAR')).stdout, '2 web\n', "the create's and the template's envs")
    eq((await w.getInfo()).templateId, 'web', 'templateId')
    await w.kill()
  })
  await step('8 sandboxes created at once, each running a command', async () => {
    // Five minutes each to be made and to live: eight at once take 6 to
    // 10 s here, and several times that on a slow host.
    const all = await Promise.all(Array.from({ length: 8 }, (_, i) => Sandbox.create('web', { timeoutMs: 300_000, requestTimeoutMs: 300_000 })
      .then(async (s) => [s, (await s.commands.run(`echo ${i} $(hostname)`)).stdout])))
    const outs = all.map(([, out]) => out.trim())
    eq(outs.map((o) => o.split(' ')[0]), ['0', '1', '2', '3', '4', '5', '6', '7'], 'each its own command')
    eq(new Set(outs.map((o) => o.split(' ')[1])).size, 8, 'eight hostnames')
    await Promise.all(all.map(([s]) => s.kill()))
  })
  await step('a template booted on create: its environment and start command', async () => {
    const p = await Sandbox.create('plain', { timeoutMs: 60_000 })
    let started = false
    for (let i = 0; i < 100 && !started; i++) {
      started = await p.files.exists('/tmp/started')
      if (!started) await sleep(100)
    }
    check(started, 'the start command did not run')
    eq((await p.commands.run('echo $TEMPLATE_VAR')).stdout, 'plain\n', "the template's env")
    await p.kill()
  })
  await step('setTimeout and getInfo', async () => {
    await sbx.setTimeout(500_000)
    const info = await sbx.getInfo()
    const left = (info.endAt.getTime() - Date.now()) / 1000
    check(left > 480 && left < 520, `endAt is ${left}s away, want about 500`)
    eq([info.sandboxId, info.templateId, info.state, info.metadata.run], [sbx.sandboxId, template, 'running', run], 'info')
  })
  await step('getMetrics', async () => {
    const m = await sbx.getMetrics()
    check(m.length >= 1 && m[0].cpuCount >= 1 && m[0].memTotal > 0, `metrics ${JSON.stringify(m)}`)
  })
  let short
  await step('list by metadata, over two pages', async () => {
    short = await Sandbox.create(template, { timeoutMs: 8_000, metadata: meta })
    const pages = Sandbox.list({ query: { metadata: { run } }, limit: 1 })
    const a = await pages.nextItems()
    check(pages.hasNext, 'no second page')
    const b = await pages.nextItems()
    const ids = [...a, ...b].map((s) => s.sandboxId).sort()
    eq(ids, [sbx.sandboxId, short.sandboxId].sort(), 'the two pages')
    eq((await Sandbox.list({ query: { metadata: { run: 'other' } } }).nextItems()).length, 0, 'another run')
  })
  await step('a sandbox ends at its timeout', async () => {
    // Its 8 s from its create, then the stop's grace (10 s) at most;
    // polled from now (the listing above took some of it) for up to 70
    // s, for a slow host.
    for (let i = 0; i < 70; i++) {
      try {
        await Sandbox.getInfo(short.sandboxId)
      } catch (e) {
        if (e instanceof NotFoundError) break
        throw e
      }
      await sleep(1_000)
    }
    await expectThrow(() => Sandbox.getInfo(short.sandboxId), NotFoundError, 'getInfo after the timeout')
  })
  await step("another API key reaches none of this key's sandboxes", async () => {
    const other = { apiKey: process.env.E2B_OTHER_KEY }
    await expectThrow(() => Sandbox.getInfo(sbx.sandboxId, other), NotFoundError, "another key's getInfo")
    eq(await Sandbox.kill(sbx.sandboxId, other), false, "another key's kill")
    check(!(await Sandbox.list(other).nextItems()).some((s) => s.sandboxId === sbx.sandboxId), 'another key lists it')
    eq((await sbx.commands.run('echo still')).stdout, 'still\n', 'the sandbox, after')
  })
  await step('errors: a bad key, an unknown sandbox, a command past its timeout', async () => {
    await expectThrow(() => Sandbox.list({ apiKey: 'e2b_' + '0'.repeat(40) }).nextItems(), AuthenticationError, 'a bad key')
    await expectThrow(() => Sandbox.getInfo('inosuchsandbox'), NotFoundError, 'an unknown sandbox')
    await expectThrow(() => sbx.commands.run('sleep 30', { timeoutMs: 1000 }), TimeoutError, 'sleep 30 with a 1 s timeout')
  })
  await step('fork of 3: running copies with the source\'s files', async () => {
    await sbx.files.write('forked.txt', 'from the source')
    const copies = await sbx.fork({ count: 3, timeoutMs: 120_000 })
    eq(copies.length, 3, 'copies')
    for (const c of copies) check(!(c instanceof Error), `a copy failed: ${c?.message}`)
    const outs = await Promise.all(copies.map((c) => c.commands.run('cat forked.txt; echo; hostname')))
    const hosts = new Set()
    for (const o of outs) {
      const [file, host] = o.stdout.split('\n')
      eq(file, 'from the source', 'a copy\'s file')
      hosts.add(host)
    }
    eq(hosts.size, 3, 'distinct hostnames')
    const ids = copies.map((c) => c.sandboxId)
    check(new Set([...ids, sbx.sandboxId]).size === 4, `copy IDs ${ids}`)
    await Promise.all(copies.map((c) => c.kill()))
    eq((await sbx.commands.run('cat forked.txt')).stdout, 'from the source', 'the source still runs')
  })
  await step('snapshot, then a sandbox created from it', async () => {
    const snap = await sbx.createSnapshot()
    const listed = await sbx.listSnapshots().nextItems()
    check(listed.some((x) => x.snapshotId === snap.snapshotId), `listSnapshots: ${JSON.stringify(listed)}`)
    const other = { apiKey: process.env.E2B_OTHER_KEY }
    eq(await Sandbox.deleteSnapshot(snap.snapshotId, other), false, "another key's delete")
    eq((await Sandbox.listSnapshots(other).nextItems()).length, 0, "another key's list")
    const from = await Sandbox.create(snap.snapshotId, { timeoutMs: 60_000 })
    eq(await from.files.read('forked.txt'), 'from the source', 'its file')
    await from.kill()
    eq(await Sandbox.deleteSnapshot(snap.snapshotId), true, 'delete')
    eq(await Sandbox.deleteSnapshot(snap.snapshotId), false, 'delete again')
  })
  await step('updateNetwork: the rules replaced, in getInfo; refused for a sandbox made without internet access', async () => {
    await sbx.updateNetwork({ allowOut: ['1.1.1.1'], denyOut: [sdk.ALL_TRAFFIC] })
    let info = await sbx.getInfo()
    eq([info.allowInternetAccess, info.network.allowOut, info.network.denyOut], [true, ['1.1.1.1'], ['0.0.0.0/0']], 'after the update')
    await sbx.updateNetwork({ denyOut: ['8.8.8.8'] })
    info = await sbx.getInfo()
    eq([info.network.allowOut, info.network.denyOut], [undefined, ['8.8.8.8']], 'after a second update (what it leaves out is cleared)')
    await sbx.updateNetwork({ allowInternetAccess: false })
    eq((await sbx.getInfo()).allowInternetAccess, false, 'after allowInternetAccess: false')
    await sbx.updateNetwork({})
    eq((await sbx.getInfo()).allowInternetAccess, true, 'after an update with no rules')
    eq((await sbx.commands.run('echo still')).stdout, 'still\n', 'the sandbox after the updates')
    await expectThrow(() => sbx.updateNetwork({ egressProxy: { address: 'proxy.example' } }), Error, 'an egress proxy without a port')
    const off = await Sandbox.create(template, { timeoutMs: 60_000, allowInternetAccess: false })
    eq((await off.getInfo()).allowInternetAccess, false, 'made without internet access')
    await expectThrow(() => off.updateNetwork({ allowOut: ['1.1.1.1'] }), Error, 'opening a sandbox made without a network')
    await off.kill()
  })
  await step('network rules: a header set on HTTPS requests to its host (a pre-booted template, restored, and an image booted), in getInfo; updateNetwork replaces and clears them, and refuses a host the sandbox did not intercept', async () => {
    const value = process.env.RULE_VALUE
    const rule = (v) => ({ 'api.example.test': [{ transform: { headers: { authorization: `Bearer ${v}` } } }] })
    // python trusting the sandbox's CA alone: the request is intercepted
    // or fails.
    const get = (s) => s.commands.run(`python3 -c 'import ssl, urllib.request; ctx = ssl.create_default_context(cafile="/etc/ssl/certs/capsa-ca.pem"); print(urllib.request.urlopen("https://api.example.test/rules", context=ctx, timeout=60).read().decode())'`)
    const made = []
    for (const tmpl of ['web', template]) {
      const s = await Sandbox.create(tmpl, { timeoutMs: 180_000, requestTimeoutMs: 300_000, network: { rules: rule(value) } })
      made.push(s)
      eq((await get(s)).stdout, `auth=Bearer ${value}\n`, `${tmpl}: what the server got`)
      eq((await s.getInfo()).network.rules, { 'api.example.test': [{ transform: { headers: { Authorization: `Bearer ${value}` } } }] }, `${tmpl}: getInfo's rules`)
    }
    const s = made[0]
    await s.updateNetwork({ rules: rule('second') })
    eq((await get(s)).stdout, 'auth=Bearer second\n', 'after updateNetwork')
    await expectThrow(() => s.updateNetwork({ rules: { 'other.example.test': [{ transform: { headers: { A: 'b' } } }] } }), Error, 'a rule for a host the sandbox did not intercept')
    eq((await get(s)).stdout, 'auth=Bearer second\n', 'after the refused update')
    await s.updateNetwork({})
    eq((await s.getInfo()).network.rules, undefined, 'getInfo after an update without rules')
    await expectThrow(() => get(s), CommandExitError, 'a request once the rules are cleared (not intercepted: the real certificate)')
    await expectThrow(() => Sandbox.create(template, { network: { rules: { '10.0.0.1': [{ transform: { headers: { A: 'b' } } }] } } }), Error, 'a rule for an IP address')
    await Promise.all(made.map((m) => m.kill()))
  })
  await step('network.egressProxy: the sandbox\'s TCP through a SOCKS5 server with credentials (a real one, from npm), in getInfo without the password; a proxy refusing the credentials fails closed; updateNetwork without it goes direct', async () => {
    const { createServer } = await import('@pondwader/socks5-server')
    const user = 'agent'
    const password = process.env.PROXY_PASSWORD
    const seen = []
    const server = createServer({ auth: { username: user, password } })
    server.setRulesetValidator((conn) => {
      seen.push(`${conn.username} ${conn.destAddress}:${conn.destPort}`)
      return true
    })
    await new Promise((resolve) => server.listen(Number(process.env.PROXY_PORT), '127.0.0.1', resolve))
    const proxy = { address: `127.0.0.1:${process.env.PROXY_PORT}`, username: user, password }
    // The stand-in public host's page, over plain HTTP.
    const get = (s) => s.commands.run(`python3 -c 'import urllib.request; print(urllib.request.urlopen("http://${process.env.PUBLIC_IP}/", timeout=30).read().decode().strip())'`)
    const s = await Sandbox.create(template, { timeoutMs: 120_000, network: { egressProxy: proxy } })
    try {
      eq((await get(s)).stdout, 'public page\n', 'through the proxy')
      eq(seen, [`${user} ${process.env.PUBLIC_IP}:80`], 'what the proxy was asked')
      eq((await s.getInfo()).network.egressProxy, { address: proxy.address, username: user }, "getInfo's proxy")
      await s.updateNetwork({ egressProxy: { ...proxy, password: 'not-the-password' } })
      await expectThrow(() => get(s), CommandExitError, 'a request through a proxy that refuses the credentials')
      await s.updateNetwork({})
      eq((await s.getInfo()).network.egressProxy, undefined, 'getInfo after an update without it')
      eq((await get(s)).stdout, 'public page\n', 'straight out once it is cleared')
      eq(seen.length, 1, 'requests the proxy passed')
    } finally {
      await s.kill()
      server.close()
    }
  })
  await step('pause, then connect resumes with files and processes intact', async () => {
    const bg = await sbx.commands.run('sleep 1000', { background: true })
    eq(await sbx.pause(), true, 'pause')
    eq((await Sandbox.list({ query: { metadata: { run }, state: ['paused'] } }).nextItems()).map((s) => s.sandboxId), [sbx.sandboxId], 'listed as paused')
    const again = await Sandbox.connect(sbx.sandboxId)
    eq(await again.files.read('notes/a.txt'), 'héllo\n', 'the file')
    const list = await again.commands.list()
    check(list.some((p) => p.pid === bg.pid), 'the background process is gone')
    await again.commands.kill(bg.pid)
  })
  await step('pause without memory: connect boots it again from its disk, with its template\'s start command; onResume reboot does the same for a pause with memory', async () => {
    const c = await Sandbox.create('plain', { timeoutMs: 120_000 })
    const bootID = async (sb) => (await sb.commands.run('cat /proc/sys/kernel/random/boot_id')).stdout
    const first = await bootID(c)
    await c.files.write('kept.txt', 'on the disk\n')
    const bg = await c.commands.run('sleep 1000', { background: true })
    eq(await c.pause({ keepMemory: false }), true, 'pause({ keepMemory: false })')
    eq((await c.getInfo()).state, 'paused', 'paused without memory')
    const again = await Sandbox.connect(c.sandboxId, { timeoutMs: 120_000 })
    const second = await bootID(again)
    check(second !== first, `booted again: boot_id ${first.trim()} before, ${second.trim()} after`)
    eq(await again.files.read('kept.txt'), 'on the disk\n', 'its file, after the reboot')
    check(!(await again.commands.list()).some((p) => p.pid === bg.pid), 'the background process did not survive the reboot')
    eq((await again.commands.run('for i in $(seq 100); do [ -e /tmp/started ] && break; sleep 0.1; done; ls /tmp/started')).stdout, '/tmp/started\n', "the template's start command ran again")
    // A pause with memory resumes from it, the reboot forgotten...
    eq(await again.pause(), true, 'pause with memory')
    const restored = await Sandbox.connect(c.sandboxId, { timeoutMs: 120_000 })
    eq(await bootID(restored), second, 'resumed from memory: the same boot')
    // ...unless the connect asks for a reboot.
    eq(await restored.pause(), true, 'pause with memory again')
    const rebooted = await Sandbox.connect(c.sandboxId, { timeoutMs: 120_000, onResume: 'reboot' })
    check((await bootID(rebooted)) !== second, "onResume: 'reboot' booted it again")
    eq(await rebooted.files.read('kept.txt'), 'on the disk\n', "its file, after onResume: 'reboot'")
    await rebooted.kill()
  })
  await step('at its timeout, a sandbox made to pause pauses; connect, or with autoResume any request, resumes it', async () => {
    // c pauses without its memory (keepMemory: false): connect boots it.
    const [a, b, c] = await Promise.all([
      Sandbox.create('web', { timeoutMs: 60_000, lifecycle: { onTimeout: 'pause' } }),
      Sandbox.create('web', { timeoutMs: 60_000, lifecycle: { onTimeout: 'pause', autoResume: true } }),
      Sandbox.create('web', { timeoutMs: 60_000, lifecycle: { onTimeout: { action: 'pause', keepMemory: false } } }),
    ])
    await a.files.write('kept.txt', 'a')
    await c.files.write('kept.txt', 'c')
    const cBoot = (await c.commands.run('cat /proc/sys/kernel/random/boot_id')).stdout
    eq((await a.getInfo()).lifecycle, { onTimeout: 'pause', autoResume: false }, 'lifecycle')
    // Short timeouts only now: on a slow host the creates and the write
    // must not race them. Then up to 90 s for all to be on disk.
    await Promise.all([a.setTimeout(2_000), b.setTimeout(2_000), c.setTimeout(2_000)])
    let states
    for (let i = 0; i < 90; i++) {
      states = [(await a.getInfo()).state, (await b.getInfo()).state, (await c.getInfo()).state]
      if (states.every((st) => st === 'paused')) break
      await sleep(1_000)
    }
    eq(states, ['paused', 'paused', 'paused'], 'after the timeout')
    const cAgain = await Sandbox.connect(c.sandboxId, { timeoutMs: 60_000 })
    check((await cAgain.commands.run('cat /proc/sys/kernel/random/boot_id')).stdout !== cBoot, 'keepMemory: false: connect booted it again')
    eq(await cAgain.files.read('kept.txt'), 'c', 'its file, after the reboot')
    await cAgain.kill()
    // A request reaches the autoResume one; the other is connected to.
    eq((await b.commands.run('echo woke')).stdout, 'woke\n', 'a command wakes it')
    eq((await b.getInfo()).state, 'running', 'resumed by the request')
    const again = await Sandbox.connect(a.sandboxId, { timeoutMs: 60_000 })
    eq(await again.files.read('kept.txt'), 'a', 'its file, after connect')
    const info = await again.getInfo()
    check(info.state === 'running' && info.endAt.getTime() - Date.now() > 50_000, `after connect: ${info.state}, ends in ${(info.endAt.getTime() - Date.now()) / 1000}s`)
    await Promise.all([a.kill(), b.kill()])
  })
  await step('volumes: create, seed and read through their file API, mount (a pre-booted template boots), pause and resume, mount again by name, list, destroy', async () => {
    const { Volume, VolumeNotFoundError } = sdk
    const other = { apiKey: process.env.E2B_OTHER_KEY }
    const vol = await Volume.create(`data-${run}`)
    check(vol.volumeId && vol.name === `data-${run}` && vol.token, `Volume.create: ${JSON.stringify(vol)}`)
    await expectThrow(() => Volume.create(`data-${run}`), Error, 'a second volume of the name')
    await expectThrow(() => Sandbox.create(template, { volumeMounts: { '/mnt/x': 'nosuch' } }), Error, 'mounting no such volume')
    // The host seeds it through the volume's own file API.
    await vol.makeDir('/seed/deep', { force: true })
    eq((await vol.writeFile('/seed/deep/in.txt', 'from the host\n')).size, 14, 'writeFile')
    eq((await vol.writeFile('/seed/deep/over.txt', 'x')).size, 1, 'writeFile')
    eq((await vol.writeFile('/seed/deep/over.txt', 'replaced')).size, 8, 'writeFile over a file')
    check(await vol.exists('/seed/deep/in.txt') && !(await vol.exists('/nosuch')), 'exists')
    const a = await Sandbox.create('web', { timeoutMs: 120_000, volumeMounts: { '/mnt/data': vol } })
    eq((await a.getInfo()).volumeMounts, [{ name: vol.name, path: '/mnt/data' }], 'getInfo().volumeMounts')
    await vol.writeFile('/live.txt', 'while mounted\n')
    eq((await a.commands.run('cat /mnt/data/seed/deep/in.txt /mnt/data/live.txt')).stdout, 'from the host\nwhile mounted\n', "the host's files, in the sandbox")
    await a.commands.run('mkdir -p /mnt/data/d && echo kept > /mnt/data/f && echo deep > /mnt/data/d/g')
    // Booted, not restored: the template's start command ran.
    const site = await a.commands.run('for i in $(seq 100); do [ -s /tmp/site/index.html ] && break; sleep 0.1; done; cat /tmp/site/index.html')
    eq(site.stdout, 'prebooted\n', "the template's start command, on a booted sandbox")
    await expectThrow(() => Volume.destroy(vol.volumeId), Error, 'destroying a mounted volume')
    eq(await a.pause(), true, 'pause')
    const again = await Sandbox.connect(a.sandboxId, { timeoutMs: 60_000 })
    eq((await again.commands.run('cat /mnt/data/f && echo more >> /mnt/data/f')).stdout, 'kept\n', 'the volume after a resume')
    await again.kill()
    const b = await Sandbox.create(template, { timeoutMs: 60_000, volumeMounts: { '/data': vol.name } })
    eq((await b.commands.run('cat /data/f /data/d/g')).stdout, 'kept\nmore\ndeep\n', "the first sandbox's files, in the second")
    await b.kill()
    eq(await vol.readFile('/f'), 'kept\nmore\n', "readFile of the sandboxes' file")
    eq((await vol.list('/', { depth: 2 })).map((e) => e.path).sort(), ['/d', '/d/g', '/f', '/live.txt', '/seed', '/seed/deep'], 'list, depth 2')
    const f = await vol.getInfo('/f')
    eq([f.size, f.uid, f.mtime instanceof Date], [10, 1000, true], 'getInfo of a file a sandbox wrote')
    eq((await vol.updateMetadata('/f', { mode: 0o600 })).mode, 0o600, 'updateMetadata')
    await vol.remove('/seed')
    check(!(await vol.exists('/seed/deep/in.txt')), 'the removed tree is gone')
    await expectThrow(() => vol.readFile('/seed/deep/in.txt'), sdk.VolumePathNotFoundError, 'readFile of a removed file')
    eq((await Volume.list()).filter((v) => v.name === vol.name), [{ volumeId: vol.volumeId, name: vol.name }], 'Volume.list')
    eq((await Volume.list(other)).length, 0, "another key's list")
    await expectThrow(() => Volume.getInfo(vol.volumeId, other), VolumeNotFoundError, "another key's getInfo")
    eq((await Volume.connect(vol.volumeId)).token, vol.token, 'Volume.connect')
    eq(await Volume.destroy(vol.volumeId), true, 'destroy')
    eq(await Volume.destroy(vol.volumeId), false, 'destroy again')
    await expectThrow(() => Volume.getInfo(vol.volumeId), VolumeNotFoundError, 'getInfo after destroy')
  })
  await step('kill', async () => {
    const k = await Sandbox.create(template, { timeoutMs: 60_000 })
    eq(await k.kill(), true, 'kill')
    eq(await Sandbox.kill(k.sandboxId), false, 'killing it again')
  })
  // The sandbox kept for after-restart: its timeout from now on covers
  // the old SDK's run, a suspension and the server's restart (its resume
  // above set it to connect's default, 300 s, which a slow run outlasts).
  await step('setTimeout on the sandbox kept for after-restart', () => sbx.setTimeout(900_000))
  console.log(`keep ${sbx.sandboxId}`)
} else if (mode === 'after-restart') {
  await step('reach a sandbox after the server restarted', async () => {
    const sbx = await Sandbox.connect(process.argv[3])
    eq(await sbx.files.read('notes/a.txt'), 'héllo\n', 'the file')
    const r = await sbx.commands.run('echo still here')
    eq(r.stdout, 'still here\n', 'a command')
    await sbx.kill()
  })
} else if (mode === 'old') {
  let sbx
  await step('Sandbox.create (POST /sandboxes)', async () => {
    sbx = await Sandbox.create(template, { timeoutMs: 120_000, envs: { FROM_CREATE: '1' } })
    return sbx.sandboxId
  })
  if (sbx) {
    await basics(sbx)
    await step('kill', async () => { await sbx.kill() })
  }
} else if (mode === 'bench') {
  const { createInterface } = await import('node:readline')
  let kept
  const firstOutput = async (tmpl) => {
    const t0 = performance.now()
    const sbx = await Sandbox.create(tmpl, { timeoutMs: 300_000 })
    let first
    await sbx.commands.run('echo hi', { onStdout: () => { first ??= performance.now() } })
    const ms = first - t0
    await sbx.kill()
    return ms
  }
  for await (const line of createInterface({ input: process.stdin })) {
    const [cmd, arg, n] = line.split(' ')
    try {
      let ms
      if (cmd === 'first-output') {
        ms = await firstOutput(arg)
      } else if (cmd === 'concurrent') {
        const t0 = performance.now()
        const all = await Promise.all(Array.from({ length: Number(n) }, () => Sandbox.create(arg, { timeoutMs: 300_000 })
          .then(async (s) => { await s.commands.run('echo hi'); return s })))
        ms = performance.now() - t0
        await Promise.all(all.map((s) => s.kill()))
      } else if (cmd === 'keep') {
        kept = await Sandbox.create(arg, { timeoutMs: 3_600_000 })
        console.log(`id ${kept.sandboxId}`)
        continue
      } else if (cmd === 'run-true') {
        const t0 = performance.now()
        await kept.commands.run('true')
        ms = performance.now() - t0
      } else {
        throw new Error(`unknown command ${cmd}`)
      }
      console.log(`ms ${ms}`)
    } catch (e) {
      console.log(`error: ${e?.constructor?.name}: ${e?.message ?? e}`.replaceAll('\n', ' | '))
    }
  }
  if (kept) await kept.kill()
} else {
  console.log(`FAIL mode: unknown mode ${mode}`)
  failed++
}
process.exit(failed ? 1 : 0)
