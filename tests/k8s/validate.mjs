// Checks moecache's Kubernetes manifests: every object of `kubectl kustomize deploy/kubernetes`
// and of the examples against the Kubernetes API schemas (the typed models of kubernetes-models
// and @kubernetes-models/prometheus-operator), then the fields that make the deployment work:
// capabilities, the seccomp profile, host paths shared with inference pods, the memory the budgets
// need, and the labels that tie the Service, the ServiceMonitor and the dashboard together.
//   node tests/k8s/validate.mjs RENDERED.yaml EXAMPLE.yaml... --source SOURCE_DIR
import { readFileSync, existsSync } from 'node:fs';
import { parseAllDocuments } from 'yaml';
import * as core from 'kubernetes-models/v1';
import * as apps from 'kubernetes-models/apps/v1';
import * as networking from 'kubernetes-models/networking.k8s.io/v1';
import * as monitoring from '@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1';

const args = process.argv.slice(2);
const src = args.includes('--source') ? args[args.indexOf('--source') + 1] : '.';
const files = args.filter((a, i) => a !== '--source' && args[i - 1] !== '--source');
const failures = [];
const fail = (what) => failures.push(what);
const models = {
  'v1/Namespace': core.Namespace, 'v1/ServiceAccount': core.ServiceAccount, 'v1/ConfigMap': core.ConfigMap,
  'v1/Service': core.Service, 'v1/Pod': core.Pod, 'apps/v1/DaemonSet': apps.DaemonSet,
  'networking.k8s.io/v1/NetworkPolicy': networking.NetworkPolicy,
  'monitoring.coreos.com/v1/ServiceMonitor': monitoring.ServiceMonitor,
};

const objects = [];
for (const file of files) {
  for (const doc of parseAllDocuments(readFileSync(file, 'utf8'))) {
    if (doc.errors.length) { fail(`${file}: ${doc.errors[0].message}`); continue; }
    const o = doc.toJS();
    if (o == null) continue;
    const Model = models[`${o.apiVersion}/${o.kind}`];
    const name = `${o.kind} ${o.metadata?.name} (${file})`;
    if (typeof o.metadata?.name !== 'string') { fail(`${name}: no metadata.name`); continue; }
    if (!Model) { fail(`${name}: no schema for ${o.apiVersion} ${o.kind}`); continue; }
    try { new Model(o).validate(); } catch (e) { fail(`${name}: ${e.message}`); }
    objects.push(o);
  }
}
const find = (kind, name) => objects.find((o) => o.kind === kind && o.metadata.name === name);
const bytes = (s) => {
  const m = /^([0-9.]+)\s*(B|KiB|MiB|GiB|TiB|Ki|Mi|Gi|Ti)?$/.exec(String(s).trim());
  if (!m) return NaN;
  const unit = { B: 1, KiB: 2 ** 10, MiB: 2 ** 20, GiB: 2 ** 30, TiB: 2 ** 40, Ki: 2 ** 10, Mi: 2 ** 20, Gi: 2 ** 30, Ti: 2 ** 40 }[m[2] ?? 'B'];
  return Number(m[1]) * unit;
};

const ds = find('DaemonSet', 'moecached');
if (!ds) fail('no DaemonSet moecached');
else {
  const pod = ds.spec.template.spec;
  const c = pod.containers.find((x) => x.name === 'moecached');
  const caps = c?.securityContext?.capabilities ?? {};
  for (const cap of ['IPC_LOCK', 'BPF', 'PERFMON', 'SYS_RESOURCE', 'FOWNER'])
    if (!(caps.add ?? []).includes(cap)) fail(`DaemonSet: capability ${cap} is not added`);
  // Its own user: SETUID, SETGID and SETPCAP only for the switch (--user), nothing else.
  for (const cap of caps.add ?? [])
    if (!['IPC_LOCK', 'BPF', 'PERFMON', 'SYS_RESOURCE', 'FOWNER', 'SETUID', 'SETGID', 'SETPCAP'].includes(cap))
      fail(`DaemonSet: capability ${cap} is added, which the daemon does not use`);
  if (!(caps.drop ?? []).includes('ALL')) fail('DaemonSet: capabilities are not dropped first (drop: ALL)');
  if (c?.securityContext?.allowPrivilegeEscalation !== false) fail('DaemonSet: allowPrivilegeEscalation is not false');
  const userArg = (c?.args ?? [])[(c?.args ?? []).indexOf('--user') + 1];
  const daemonUid = /^(\d+):(\d+)$/.exec(userArg ?? '')?.[1];
  if (!(c?.args ?? []).includes('--user') || !daemonUid || daemonUid === '0')
    fail('DaemonSet: moecached is not told to run as its own user (--user UID:GID, not root)');
  const sp = c?.securityContext?.seccompProfile;
  if (sp?.type !== 'Localhost') fail('DaemonSet: no Localhost seccomp profile (the runtime default denies io_uring)');
  else if (!existsSync(`${src}/deploy/kubernetes/seccomp/${String(sp.localhostProfile).split('/').pop()}`))
    fail(`DaemonSet: seccomp profile ${sp.localhostProfile} is not in deploy/kubernetes/seccomp/`);
  if (pod.hostPID !== true) fail('DaemonSet: hostPID is not set (the runtimes\' pids are the host\'s)');
  if (pod.nodeSelector?.['nvidia.com/gpu.present'] !== 'true') fail('DaemonSet: no GPU node selector');
  const hostPath = (name) => pod.volumes.find((v) => v.name === name)?.hostPath?.path;
  const mountOf = (container, name) => container.volumeMounts?.find((m) => m.name === name)?.mountPath;
  if (hostPath('socket') !== '/run/moecache' || mountOf(c, 'socket') !== '/run/moecache')
    fail('DaemonSet: the client socket is not the host\'s /run/moecache');
  if (!String(hostPath('state')).startsWith('/var/lib/moecache')) fail('DaemonSet: state is not kept on the host');
  const port = c.ports?.find((p) => p.name === 'metrics');
  const image = readFileSync(`${src}/deploy/container/moecached.toml`, 'utf8');
  if (!/^listen = "127\.0\.0\.1:\d+"/m.test(image)) fail('the image\'s [metrics] listen is not loopback (an operator opts in)');
  const dropIn = find('ConfigMap', 'moecached-config')?.data?.['10-node.toml'] ?? '';
  if (!port || !dropIn.includes(`listen = "0.0.0.0:${port.containerPort}"`))
    fail('DaemonSet: the node drop-in does not listen on the metrics port for the pod\'s IP');
  for (const probe of ['readinessProbe', 'livenessProbe'])
    if (c[probe]?.httpGet?.path !== '/health') fail(`DaemonSet: ${probe} is not /health (a slow /metrics would restart the daemon)`);
  const np = objects.find((o) => o.kind === 'NetworkPolicy' && o.spec?.podSelector?.matchLabels?.['app.kubernetes.io/name'] === 'moecached');
  if (!np) fail('no NetworkPolicy for moecached\'s port');
  else if (!(np.spec.ingress ?? []).every((r) => (r.from ?? []).length > 0 && (r.ports ?? []).some((p) => p.port === port?.containerPort)))
    fail('NetworkPolicy: an ingress rule open to every source or not for the metrics port');
  // Memory: the budgets of the drop-in, and 256 MiB for the daemon.
  const cm = find('ConfigMap', 'moecached-config');
  const toml = cm?.data?.['10-node.toml'] ?? '';
  const lock = bytes(/^lock = "([^"]+)"/m.exec(toml)?.[1]), reserve = bytes(/^reserve = "([^"]+)"/m.exec(toml)?.[1]);
  const want = lock + reserve + 256 * 2 ** 20;
  for (const which of ['requests', 'limits'])
    if (bytes(c.resources?.[which]?.memory) !== want)
      fail(`DaemonSet: memory ${which} ${c.resources?.[which]?.memory} is not lock + reserve + 256Mi (${want / 2 ** 20}Mi)`);
  const fleet = /^fleet_profiles = "([^"]+)"/m.exec(toml)?.[1];
  if (!fleet || mountOf(c, 'fleet-profiles') !== fleet) fail('DaemonSet: fleet_profiles is not where the fleet\'s ConfigMap is mounted');
  if (!pod.volumes.find((v) => v.name === 'fleet-profiles')?.configMap?.optional) fail('DaemonSet: the fleet profiles are not optional');
  // The preload libraries: put on the host by the init container, where inference pods find them.
  const init = pod.initContainers?.find((x) => x.name === 'prepare-node');
  const libHost = hostPath('preload-libraries');
  if (!init || !libHost || !init.command.join(' ').includes(mountOf(init, 'preload-libraries')))
    fail('DaemonSet: no init container copying the preload libraries to the host');
  // The host directories the daemon writes are its user's.
  for (const v of ['socket', 'state'])
    if (!init?.command.join(' ').includes(`chown -R ${userArg} `) || !init.command.join(' ').includes(mountOf(init, v) ?? '\0'))
      fail(`DaemonSet: the init container does not give ${v}'s host directory to the daemon's user (${userArg})`);
  const example = objects.find((o) => o.kind === 'Pod' && o.metadata.name === 'llama-server');
  if (!example) fail('no example inference pod');
  else {
    const ec = example.spec.containers[0];
    const env = Object.fromEntries(ec.env.map((e) => [e.name, e.value]));
    const vol = (name) => example.spec.volumes.find((v) => v.name === name)?.hostPath?.path;
    const preload = ec.volumeMounts.find((m) => env.LD_PRELOAD?.startsWith(`${m.mountPath}/`));
    if (!preload || vol(preload.name) !== libHost) fail('example pod: LD_PRELOAD is not the library the DaemonSet puts on the host');
    if (!init?.command.join(' ').includes(env.LD_PRELOAD?.split('/').pop())) fail('example pod: the init container does not copy that library');
    const sock = ec.volumeMounts.find((m) => env.MOECACHE_SOCKET?.startsWith(`${m.mountPath}/`));
    if (!sock || vol(sock.name) !== '/run/moecache') fail('example pod: MOECACHE_SOCKET is not the node\'s socket');
    if (env.LLAMA_ARG_LOAD_MODE !== 'mmap') fail('example pod: the model is not mapped (LLAMA_ARG_LOAD_MODE=mmap)');
    if (env.GGML_OP_OFFLOAD_MIN_BATCH !== '1') fail('example pod: GGML_OP_OFFLOAD_MIN_BATCH is not 1');
    if (env.MOECACHE_DAEMON_USER !== daemonUid) fail(`example pod: MOECACHE_DAEMON_USER is not the daemon's uid (${daemonUid}): the hook would not trust its socket`);
  }
}
const svc = find('Service', 'moecached-metrics');
const podLabels = ds?.spec.template.metadata.labels ?? {};
if (!svc) fail('no metrics Service');
else {
  for (const [k, v] of Object.entries(svc.spec.selector ?? {})) if (podLabels[k] !== v) fail(`Service: selector ${k}=${v} matches no moecached pod`);
  if (!svc.spec.ports.some((p) => p.name === 'metrics')) fail('Service: no port named metrics');
}
const sm = find('ServiceMonitor', 'moecached');
if (!sm) fail('no ServiceMonitor');
else {
  for (const [k, v] of Object.entries(sm.spec.selector.matchLabels ?? {}))
    if (svc?.metadata.labels?.[k] !== v) fail(`ServiceMonitor: selector ${k}=${v} matches not the Service`);
  if (!sm.spec.endpoints.some((e) => svc?.spec.ports.some((p) => p.name === e.port))) fail('ServiceMonitor: its endpoint port is not the Service\'s');
}
const dash = find('ConfigMap', 'moecache-grafana-dashboard');
if (!dash) fail('no dashboard ConfigMap');
else {
  if (dash.metadata.labels?.grafana_dashboard !== '1') fail('dashboard ConfigMap: no grafana_dashboard label (the sidecar does not see it)');
  try {
    const j = JSON.parse(dash.data['grafana-dashboard.json']);
    if (!(j.panels?.length > 0)) fail('dashboard ConfigMap: no panels');
  } catch (e) { fail(`dashboard ConfigMap: ${e.message}`); }
}
for (const o of objects)
  if (o.kind !== 'Namespace' && o.kind !== 'Pod' && o.metadata.namespace !== 'moecache') fail(`${o.kind} ${o.metadata.name}: not in the moecache namespace`);

if (failures.length) {
  for (const f of failures) console.log(`FAIL: ${f}`);
  process.exit(1);
}
console.log(`PASS: ${objects.length} objects valid against the Kubernetes schemas, and their fields agree`);
