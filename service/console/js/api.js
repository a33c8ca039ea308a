// The JSON API, as the console reaches it: the key (when auth is on) kept in sessionStorage
// only (this tab, gone when it closes) and sent as `Authorization: Bearer`, never in a URL.

const KEY = "layerswap.key";
export const TERMINAL = new Set(["succeeded", "failed", "canceled"]);

export class ApiError extends Error {
  constructor(status, body) {
    const error = (body && body.error) || {};
    super(error.message || `HTTP ${status}`);
    this.status = status;
    this.code = error.code || "http_" + status;
    this.details = error.details || {};
  }
}

export function storedKey() {
  return sessionStorage.getItem(KEY);
}

export function rememberKey(key) {
  sessionStorage.setItem(KEY, key);
}

export function forgetKey() {
  sessionStorage.removeItem(KEY);
}

function headers(extra) {
  const found = { Accept: "application/json", ...extra };
  const key = storedKey();
  if (key) found.Authorization = "Bearer " + key;
  return found;
}

/** GET (or `method`) `path`; the parsed JSON, or text for non-JSON answers. Throws ApiError. */
export async function api(path, { method = "GET", body, signal, accept } = {}) {
  const init = { method, signal, headers: headers(accept ? { Accept: accept } : {}) };
  if (body !== undefined) {
    init.body = JSON.stringify(body);
    init.headers["Content-Type"] = "application/json";
  }
  const response = await fetch(path, init);
  const type = response.headers.get("content-type") || "";
  const parsed = type.includes("application/json") ? await response.json() : await response.text();
  if (!response.ok) {
    if (response.status === 401) window.dispatchEvent(new CustomEvent("layerswap:unauthorized"));
    throw new ApiError(response.status, typeof parsed === "object" ? parsed : null);
  }
  return parsed;
}

/** URL query from an object, leaving out empty values. */
export function query(values) {
  const params = new URLSearchParams();
  for (const [name, value] of Object.entries(values)) {
    if (value !== undefined && value !== null && value !== "") params.set(name, value);
  }
  const text = params.toString();
  return text ? "?" + text : "";
}

/**
 * Follow a job's Server-Sent Events stream (GET …/events): `onEvent(type, data)` per event.
 * Read with fetch, not EventSource, which cannot send the Authorization header. Reconnects
 * after the server ends a long stream, from the last event id, until the job ends or
 * `signal` aborts.
 */
export async function followEvents(path, onEvent, signal) {
  let last = 0;
  while (!signal.aborted) {
    const init = { signal, headers: headers({ Accept: "text/event-stream" }) };
    if (last) init.headers["Last-Event-ID"] = String(last);
    let response;
    try {
      response = await fetch(path, init);
    } catch (error) {
      return; // aborted, or the server went away: the page's own reads show it
    }
    if (!response.ok || !response.body) return;
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    let ended = false;
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value;
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          const event = parseEvent(block);
          if (event.id) last = event.id;
          if (event.data) {
            const data = JSON.parse(event.data);
            onEvent(event.type, data);
            if (TERMINAL.has(event.type) || TERMINAL.has(data.status)) ended = true;
          }
        }
      }
    } catch (error) {
      return;
    }
    if (ended) return;
    await new Promise((resolve) => setTimeout(resolve, 1000));
  }
}

function parseEvent(block) {
  const event = { type: "message", data: "", id: 0 };
  for (const line of block.split("\n")) {
    const at = line.indexOf(":");
    if (at <= 0) continue;
    const field = line.slice(0, at);
    const value = line.slice(at + 1).replace(/^ /, "");
    if (field === "event") event.type = value;
    else if (field === "data") event.data += value;
    else if (field === "id") event.id = Number(value);
  }
  return event;
}

/**
 * Keep a job's view current: GET `path` long-polled (`?wait=`, `If-None-Match`), which the
 * server answers as soon as the job's row changes; `onChange(job)` per new view, until the job
 * ends or `signal` aborts.
 */
export async function watchJob(path, onChange, signal) {
  let etag = null;
  while (!signal.aborted) {
    const init = { signal, headers: headers(etag ? { "If-None-Match": etag } : {}) };
    let response;
    try {
      response = await fetch(`${path}?wait=30`, init);
    } catch (error) {
      return;
    }
    if (response.status === 304) continue;
    if (!response.ok) return;
    etag = response.headers.get("ETag");
    const job = await response.json();
    onChange(job);
    if (TERMINAL.has(job.status)) return;
  }
}

/**
 * Draw the page again (as if navigated to anew) when the job at `path` moves on from `shown`:
 * its status or progress. For the pages that show a job whole, each time it changes.
 */
export function redrawOnChange(path, shown, signal) {
  const moved = (job) => job.status !== shown.status || job.progress.done !== shown.progress.done;
  watchJob(path, (job) => {
    if (moved(job)) window.dispatchEvent(new HashChangeEvent("hashchange"));
  }, signal);
}

/** Where a job of `kind` is read in the API, and shown in the console. */
export const COLLECTION = {
  merge: "merges",
  evaluation: "evaluations",
  analysis: "analyses",
  sweep: "sweeps",
};
