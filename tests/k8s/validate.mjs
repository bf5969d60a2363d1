// Checks moecache's Kubernetes manifests: every object of `kubectl kustomize deploy/kubernetes`
// and of the examples against the Kubernetes API schemas (the typed models of kubernetes-models
// and @kubernetes-models/prometheus-operator), then the fields that make the deployment work:
// capabilities, the seccomp profile, host paths shared with inference pods, the memory the budgets
// need, and the labels that tie the Service, the ServiceMonitor and the dashboard together.
// Pod Security admission as the API server applies it: each pod's level (the Pod Security Standards'
// baseline and restricted checks, below) against its namespace's enforce label.
//   node tests/k8s/validate.mjs RENDERED.yaml EXAMPLE.yaml... --source SOURCE_DIR [--release NAME]
// --release: the ServiceMonitor must carry the label release=NAME (kube-prometheus-stack's selector).
import { readFileSync, existsSync } from 'node:fs';
import { parseAllDocuments } from 'yaml';
import * as core from 'kubernetes-models/v1';
import * as apps from 'kubernetes-models/apps/v1';
import * as networking from 'kubernetes-models/networking.k8s.io/v1';
import * as monitoring from '@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1';

const args = process.argv.slice(2);
const option = (name) => (args.includes(name) ? args[args.indexOf(name) + 1] : undefined);
const src = option('--source') ?? '.';
const release = option('--release');
const files = args.filter((a, i) => !a.startsWith('--') && !args[i - 1]?.startsWith('--'));
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


// ---- Pod Security Standards (kubernetes.io/docs/concepts/security/pod-security-standards) ----
// What keeps a pod spec from a level: [] when it meets it.
const baselineCaps = ['AUDIT_WRITE', 'CHOWN', 'DAC_OVERRIDE', 'FOWNER', 'FSETID', 'KILL', 'MKNOD', 'NET_BIND_SERVICE',
  'SETFCAP', 'SETGID', 'SETPCAP', 'SETUID', 'SYS_CHROOT'];
const safeSysctls = ['kernel.shm_rmid_forced', 'net.ipv4.ip_local_port_range', 'net.ipv4.ip_unprivileged_port_start',
  'net.ipv4.tcp_syncookies', 'net.ipv4.ping_group_range', 'net.ipv4.ip_local_reserved_ports', 'net.ipv4.tcp_keepalive_time',
  'net.ipv4.tcp_fin_timeout', 'net.ipv4.tcp_keepalive_intvl', 'net.ipv4.tcp_keepalive_probes'];
const restrictedVolumes = ['configMap', 'csi', 'downwardAPI', 'emptyDir', 'ephemeral', 'persistentVolumeClaim', 'projected', 'secret'];
function allContainers(spec) {
  return [...(spec.initContainers ?? []), ...(spec.containers ?? []), ...(spec.ephemeralContainers ?? [])];
}
function baselineViolations(spec) {
  const v = [];
  const psc = spec.securityContext ?? {};
  for (const ns of ['hostNetwork', 'hostPID', 'hostIPC']) if (spec[ns]) v.push(`${ns}`);
  if (psc.windowsOptions?.hostProcess) v.push('hostProcess');
  for (const vol of spec.volumes ?? []) if (vol.hostPath) v.push(`hostPath volume ${vol.name}`);
  for (const s of psc.sysctls ?? []) if (!safeSysctls.includes(s.name)) v.push(`sysctl ${s.name}`);
  const contexts = [['pod', psc], ...allContainers(spec).map((c) => [`container ${c.name}`, c.securityContext ?? {}])];
  for (const [who, sc] of contexts) {
    if (sc.privileged) v.push(`${who}: privileged`);
    if (sc.windowsOptions?.hostProcess) v.push(`${who}: hostProcess`);
    if (sc.seccompProfile?.type === 'Unconfined') v.push(`${who}: seccomp Unconfined`);
    if (sc.appArmorProfile?.type === 'Unconfined') v.push(`${who}: AppArmor Unconfined`);
    if (sc.procMount && sc.procMount !== 'Default') v.push(`${who}: procMount ${sc.procMount}`);
    const se = sc.seLinuxOptions;
    if (se && ((se.type && !['container_t', 'container_init_t', 'container_kvm_t', 'container_engine_t'].includes(se.type)) || se.user || se.role))
      v.push(`${who}: seLinuxOptions`);
    for (const cap of sc.capabilities?.add ?? []) if (!baselineCaps.includes(cap)) v.push(`${who}: capability ${cap}`);
  }
  for (const c of allContainers(spec)) for (const p of c.ports ?? []) if (p.hostPort) v.push(`container ${c.name}: hostPort ${p.hostPort}`);
  return v;
}
function restrictedViolations(spec) {
  const v = baselineViolations(spec);
  const psc = spec.securityContext ?? {};
  for (const vol of spec.volumes ?? []) {
    const kind = Object.keys(vol).find((k) => k !== 'name');
    if (!restrictedVolumes.includes(kind)) v.push(`volume ${vol.name} of type ${kind}`);
  }
  for (const c of allContainers(spec)) {
    const sc = c.securityContext ?? {};
    if (sc.allowPrivilegeEscalation !== false) v.push(`container ${c.name}: allowPrivilegeEscalation is not false`);
    if (!(sc.runAsNonRoot ?? psc.runAsNonRoot)) v.push(`container ${c.name}: runAsNonRoot is not true`);
    if ((sc.runAsUser ?? psc.runAsUser) === 0) v.push(`container ${c.name}: runAsUser 0`);
    const seccomp = (sc.seccompProfile ?? psc.seccompProfile)?.type;
    if (seccomp !== 'RuntimeDefault' && seccomp !== 'Localhost') v.push(`container ${c.name}: no RuntimeDefault or Localhost seccomp profile`);
    if (!(sc.capabilities?.drop ?? []).includes('ALL')) v.push(`container ${c.name}: capabilities not dropped (ALL)`);
    for (const cap of sc.capabilities?.add ?? []) if (cap !== 'NET_BIND_SERVICE') v.push(`container ${c.name}: capability ${cap} added`);
  }
  return v;
}
const levels = ['privileged', 'baseline', 'restricted'];
function levelOf(spec) {
  if (restrictedViolations(spec).length === 0) return 'restricted';
  if (baselineViolations(spec).length === 0) return 'baseline';
  return 'privileged';
}
// The evaluator itself, on pods whose levels are known.
{
  const tight = { containers: [{ name: 'a', securityContext: { allowPrivilegeEscalation: false, runAsNonRoot: true,
    seccompProfile: { type: 'RuntimeDefault' }, capabilities: { drop: ['ALL'] } } }], volumes: [{ name: 'c', configMap: { name: 'x' } }] };
  const loose = { containers: [{ name: 'a', securityContext: { capabilities: { add: ['CHOWN'] } } }] };
  const host = { ...loose, volumes: [{ name: 'h', hostPath: { path: '/x' } }] };
  const pid = { ...loose, hostPID: true };
  const bpf = { containers: [{ name: 'a', securityContext: { capabilities: { add: ['BPF'] } } }] };
  for (const [spec, want] of [[tight, 'restricted'], [loose, 'baseline'], [host, 'privileged'], [pid, 'privileged'], [bpf, 'privileged']])
    if (levelOf(spec) !== want) fail(`the Pod Security check itself: a pod known to be ${want} is judged ${levelOf(spec)}`);
}

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
  else {
    // Installed on the node by the init container, where the kubelet looks (its seccomp folder).
    const profile = String(sp.localhostProfile);
    const dir = `/var/lib/kubelet/seccomp/${profile.split('/').slice(0, -1).join('/')}`;
    const vol = pod.volumes.find((v) => v.hostPath?.path === dir);
    const initc = pod.initContainers?.find((x) => x.name === 'prepare-node');
    const at = vol && initc?.volumeMounts?.find((m) => m.name === vol.name)?.mountPath;
    const file = profile.split('/').pop();
    if (!at || !initc.command.join(' ').includes(`${at}/${file}`))
      fail(`DaemonSet: the init container does not install ${file} into the node's ${dir}`);
    if (!readFileSync(`${src}/scripts/image.sh`, 'utf8').includes(`deploy/kubernetes/seccomp/${file}`))
      fail(`the image (scripts/image.sh) does not carry seccomp/${file} for the init container`);
  }
  if (pod.hostPID !== true) fail('DaemonSet: hostPID is not set (the runtimes\' pids are the host\'s)');
  // GPU nodes as NVIDIA's device plugin finds them: node-feature-discovery's PCI label, or GPU
  // feature discovery's; and the taints the device plugin tolerates.
  const terms = pod.affinity?.nodeAffinity?.requiredDuringSchedulingIgnoredDuringExecution?.nodeSelectorTerms ?? [];
  const termFor = (key) => terms.some((t) => t.matchExpressions?.some((e) => e.key === key && e.operator === 'In' && e.values?.includes('true')));
  if (!termFor('feature.node.kubernetes.io/pci-10de.present')) fail('DaemonSet: no node affinity for node-feature-discovery\'s NVIDIA PCI label');
  if (!termFor('nvidia.com/gpu.present')) fail('DaemonSet: no node affinity for GPU feature discovery\'s label');
  if (pod.nodeSelector) fail('DaemonSet: a nodeSelector as well (it would AND with the affinity\'s either-or)');
  for (const key of ['nvidia.com/gpu', 'CriticalAddonsOnly'])
    if (!(pod.tolerations ?? []).some((t) => t.key === key && t.operator === 'Exists')) fail(`DaemonSet: does not tolerate ${key}`);
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

// Pod Security admission: every pod (the DaemonSet's template, the example pods applied to the
// moecache namespace) at or below what its namespace enforces, and the namespace says so.
const ns = find('Namespace', 'moecache');
const enforce = ns?.metadata.labels?.['pod-security.kubernetes.io/enforce'];
if (!levels.includes(enforce)) fail('Namespace moecache: no pod-security.kubernetes.io/enforce label');
for (const [name, spec] of [['DaemonSet moecached', ds?.spec.template.spec], ...objects.filter((o) => o.kind === 'Pod').map((o) => [`Pod ${o.metadata.name}`, o.spec])]) {
  if (!spec) continue;
  const level = levelOf(spec);
  if (levels.indexOf(level) < levels.indexOf(enforce))
    fail(`${name}: Pod Security admission at ${enforce} refuses it (${(enforce === 'restricted' ? restrictedViolations(spec) : baselineViolations(spec)).join('; ')})`);
  console.log(`Pod Security: ${name} meets ${level}${level === 'privileged' ? ` (baseline refuses: ${baselineViolations(spec).slice(0, 3).join('; ')})` : ''}; namespace enforces ${enforce}`);
}
// Labels: on every object, never rewritten into selectors (commonLabels did, and a DaemonSet's is immutable).
const kustomization = readFileSync(`${src}/deploy/kubernetes/kustomization.yaml`, 'utf8');
if (/^commonLabels:/m.test(kustomization)) fail('kustomization.yaml: commonLabels (deprecated; rewrites selectors)');
for (const o of objects)
  if (o.kind !== 'Pod' && o.metadata.labels?.['app.kubernetes.io/part-of'] !== 'moecache') fail(`${o.kind} ${o.metadata.name}: no app.kubernetes.io/part-of label`);
if (ds && Object.keys(ds.spec.selector.matchLabels).join() !== 'app.kubernetes.io/name')
  fail(`DaemonSet: its selector is ${JSON.stringify(ds.spec.selector.matchLabels)}, not its name alone`);
if (release !== undefined && sm?.metadata.labels?.release !== release)
  fail(`ServiceMonitor: no label release=${release} (kube-prometheus-stack's serviceMonitorSelector)`);

if (failures.length) {
  for (const f of failures) console.log(`FAIL: ${f}`);
  process.exit(1);
}
console.log(`PASS: ${objects.length} objects valid against the Kubernetes schemas, and their fields agree`);
