// Lineage: an artifact's ancestors (left) and descendants (right) as one graph; each job sits
// between its inputs and outputs, its edges labelled with the input's role and weight. Every
// node links to its own page.

import { api, COLLECTION } from "../api.js";
import { graph } from "../charts.js";
import { baseName, facts, h, link, number, section, shortId, table, when } from "../dom.js";

export async function render({ main, id, signal }) {
  const [up, down] = await Promise.all([
    api(`/v1/artifacts/${id}/lineage?direction=ancestors`, { signal }),
    api(`/v1/artifacts/${id}/lineage?direction=descendants`, { signal }),
  ]);
  const artifacts = new Map([...up.artifacts, ...down.artifacts].map((a) => [a.id, a]));
  const jobs = new Map([...up.jobs, ...down.jobs].map((j) => [j.job_id, j]));
  const root = artifacts.get(id);
  main.append(h("h1", {}, `Lineage of ${name(root)}`));
  const column = place(id, up.jobs, down.jobs);
  const ordered = [...column.entries()].sort((a, b) => a[1] - b[1]);
  const first = ordered.length ? ordered[0][1] : 0;
  const columns = [];
  for (const [node, at] of ordered) (columns[at - first] ||= []).push(node);
  const nodes = [
    ...[...artifacts.values()].map((a) => ({ id: a.id, kind: "artifact", root: a.id === id,
      label: name(a), sub: `${shortId(a.id)} · ${a.architecture || a.kind}` + (a.deleted_at ? " · deleted" : ""),
      href: `#/artifacts/${a.id}/lineage` })),
    ...[...jobs.values()].map((j) => ({ id: j.job_id, kind: "job", label: `${j.kind}${j.method ? " · " + j.method : ""}`,
      sub: shortId(j.job_id), href: COLLECTION[j.kind] ? `#/${COLLECTION[j.kind]}/${j.job_id}` : null })),
  ];
  const edges = [...jobs.values()].flatMap((j) => [
    ...j.inputs.map((e) => ({ from: e.artifact_id, to: j.job_id, label: edgeLabel(e) })),
    ...j.outputs.map((e) => ({ from: j.job_id, to: e.artifact_id, label: "" })),
  ]);
  main.append(section("Graph", h("div", { class: "graph-wrap" }, graph({ columns: columns.filter(Boolean), nodes, edges })),
    h("p", { class: "muted" }, "Ancestors on the left, descendants on the right; select a node to open it.")));
  main.append(section("Artifact", facts([
    ["id", h("span", { class: "mono" }, root.id)],
    ["location", h("span", { class: "mono" }, root.location)],
    ["architecture", root.architecture],
    ["layers", root.num_layers],
    ["created", when(root.created_at)],
  ]), root.scores.length ? table([["task", (sc) => sc.task], ["filter", (sc) => sc.filter],
    ["metric", (sc) => sc.metric], ["value", (sc) => number(sc.value)]], root.scores) : ""));
  main.append(section("Jobs", table([
    ["job", (j) => (COLLECTION[j.kind] ? link(`/${COLLECTION[j.kind]}/${j.job_id}`, shortId(j.job_id)) : shortId(j.job_id))],
    ["kind", (j) => j.kind],
    ["method", (j) => j.method || ""],
    ["inputs", (j) => j.inputs.map((e) => `${shortId(e.artifact_id)} ${edgeLabel(e)}`).join(", ")],
    ["outputs", (j) => j.outputs.map((e) => shortId(e.artifact_id)).join(", ")],
  ], [...jobs.values()], { class: "lineage-jobs" })));
}

function name(artifact) {
  return baseName(artifact.location || artifact.id);
}

function edgeLabel(edge) {
  // A recipe's own name for the input (`task[0]`) says its role already.
  const named = Boolean(edge.role && edge.label && edge.label.startsWith(edge.role));
  const parts = named ? [edge.label] : [edge.role, edge.label].filter(Boolean);
  if (edge.weight !== null && edge.weight !== undefined) parts.push(`w=${Number(edge.weight).toFixed(2)}`);
  return parts.join(" ");
}

/** Column of every node: the root at 0, each job one step from its artifacts. */
function place(root, ancestors, descendants) {
  const column = new Map([[root, 0]]);
  const walk = (jobs, step, from, to) => {
    let changed = true;
    while (changed) {
      changed = false;
      for (const job of jobs) {
        for (const near of job[from]) {
          if (!column.has(near.artifact_id) || column.has(job.job_id)) continue;
          const at = column.get(near.artifact_id) + step;
          column.set(job.job_id, at);
          for (const far of job[to]) if (!column.has(far.artifact_id)) column.set(far.artifact_id, at + step);
          changed = true;
        }
      }
    }
  };
  walk(ancestors, -1, "outputs", "inputs");
  walk(descendants, 1, "inputs", "outputs");
  return column;
}
