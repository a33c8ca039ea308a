// A job's event log as a timeline: time, event, stage, message. Read whole (GET …/events as
// JSON); while the job runs, followed live from its Server-Sent Events after the last one read.

import { api, followEvents, TERMINAL } from "./api.js";
import { bytes, h, shortId, when } from "./dom.js";

/** The timeline section of the job at `path` (its events at `path`/events); followed live unless
 * `follow` is false (a page that is drawn again whenever its job changes reads it each time). */
export async function timeline(path, job, signal, { follow = true } = {}) {
  const rows = h("tbody");
  const head = h("tr", {}, ["time", "event", "stage", "message"].map((t) => h("th", { scope: "col" }, t)));
  const box = h("section", { class: "card", id: "timeline", "data-live": "false" },
    h("h2", {}, "Timeline"), h("table", { class: "timeline" }, h("thead", {}, head), rows));
  const add = (type, data, createdAt) => {
    rows.append(h("tr", { "data-event": type },
      h("td", { class: "nowrap" }, when(createdAt)),
      h("td", {}, type),
      h("td", {}, data.stage || ""),
      h("td", {}, message(type, data))));
    if (TERMINAL.has(type)) box.dataset.live = "false";
  };
  const events = await api(`${path}/events`, { signal });
  for (const event of events) add(event.type, event.data, event.created_at);
  if (follow && !TERMINAL.has(job.status) && !events.some((event) => TERMINAL.has(event.type))) {
    box.dataset.live = "true";
    const last = events.length ? events[events.length - 1].id : 0;
    followEvents(`${path}/events?after=${last}`, (type, data) => add(type, data, data.created_at), signal)
      .finally(() => { box.dataset.live = "false"; });
  }
  return box;
}

/** What an event says, in words: an error, a reason, an attempt, progress, an output. */
function message(type, data) {
  if (data.message) return data.code ? `${data.code}: ${data.message}` : data.message;
  if (data.reason) return data.reason;
  if (type === "progress") {
    return `${bytes(data.bytes_done)} / ${bytes(data.bytes_total)}, ` +
      `${data.tensors_done}/${data.tensors_total} tensors`;
  }
  if (type === "running" && data.attempt) return `attempt ${data.attempt}`;
  if (data.artifact_id) return `output artifact ${shortId(data.artifact_id)}`;
  const rest = Object.entries(data).filter(([key]) => !["type", "stage", "created_at"].includes(key));
  return rest.map(([key, value]) => `${key}: ${typeof value === "object" ? JSON.stringify(value) : value}`)
    .join(", ");
}
