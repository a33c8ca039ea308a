// The executor, as a task monitor shows it (GET /v1/executor, the operator's): its workers, its
// queues' lengths, and the running jobs with their last heartbeats; read again every few
// seconds while the page is open.

import { api, COLLECTION } from "../api.js";
import { facts, h, link, section, shortId, status, table, when } from "../dom.js";

const REREAD_MS = 2000;

export async function render({ main, signal }) {
  const shown = h("div", { id: "executor" });
  main.append(h("h1", {}, "Executor"), shown);
  const draw = (found) => shown.replaceChildren(...view(found));
  draw(await api("/v1/executor", { signal }));
  const timer = setInterval(async () => {
    try {
      draw(await api("/v1/executor", { signal }));
    } catch (error) {
      // the next round tries again; a lost key shows the key prompt
    }
  }, REREAD_MS);
  signal.addEventListener("abort", () => clearInterval(timer));
}

function view(found) {
  const queues = found.queues ? Object.entries(found.queues).map(([name, length]) => ({ name, length })) : [];
  return [
    section("Overview", facts([
      ["executor", found.executor],
      ["broker", found.broker],
      ["queued jobs", found.queued],
      ["not yet sent to the broker", found.unsent],
      ["a job is presumed dead after", `${found.stale_after_s} s without a heartbeat`],
    ])),
    section("Workers", found.workers
      ? table([
        ["name", (w) => w.name],
        ["alive", (w) => h("span", { class: w.alive ? "right" : "wrong", "data-alive": String(w.alive) },
          w.alive ? "alive" : "stopped")],
        ["running", (w) => (w.job_id ? shortId(w.job_id) : "idle")],
      ], found.workers, { class: "workers" })
      : h("p", { class: "muted" }, "Celery workers take no remote commands: the jobs they run show " +
        "their heartbeats below.")),
    section("Queues", queues.length
      ? table([["queue", (q) => q.name], ["waiting", (q) => String(q.length), "num"]], queues, { class: "queues" })
      : h("p", { class: "muted" }, "Unknown while the broker cannot be reached.")),
    section("Running jobs", found.running.length
      ? table([
        ["job", (j) => link(`/${COLLECTION[j.kind]}/${j.id}`, shortId(j.id))],
        ["kind", (j) => j.kind],
        ["status", (j) => status(j.status)],
        ["stage", (j) => j.stage || ""],
        ["attempt", (j) => String(j.attempts), "num"],
        ["last heartbeat", (j) => (j.heartbeat_at ? when(j.heartbeat_at) : "none yet")],
        ["silent", (j) => (j.silent_s === null ? "" : `${j.silent_s.toFixed(1)} s`), "num"],
        ["alive", (j) => h("span", { class: j.alive ? "right" : "wrong", "data-alive": String(j.alive) },
          j.alive ? "alive" : "silent")],
      ], found.running, { class: "running" })
      : h("p", { class: "muted" }, "None.")),
  ];
}
