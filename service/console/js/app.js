// The console's router: each page is a URL fragment (#/jobs, #/merges/<id>, …), so pages can
// be bookmarked and the back button works; one module per page renders into <main>.

import { ApiError, forgetKey, rememberKey, storedKey } from "./api.js";
import { failure, h } from "./dom.js";
import * as analysis from "./pages/analysis.js";
import * as create from "./pages/create.js";
import * as evaluation from "./pages/evaluation.js";
import * as jobs from "./pages/jobs.js";
import * as lineage from "./pages/lineage.js";
import * as merge from "./pages/merge.js";
import * as sweep from "./pages/sweep.js";

const ROUTES = [
  [/^\/jobs$/, jobs],
  [/^\/merges\/(\w+)$/, merge],
  [/^\/evaluations\/(\w+)$/, evaluation],
  [/^\/analyses\/(\w+)$/, analysis],
  [/^\/sweeps\/(\w+)$/, sweep],
  [/^\/artifacts\/(\w+)\/lineage$/, lineage],
  [/^\/new\/(merge|evaluation|sweep)$/, create],
];

const main = document.getElementById("view");
let current = null; // the shown page's AbortController: stops its streams and polls

function parse() {
  const [path, search] = (location.hash.slice(1) || "/jobs").split("?");
  return { path, params: new URLSearchParams(search || "") };
}

async function show() {
  if (current) current.abort();
  current = new AbortController();
  const { signal } = current;
  const { path, params } = parse();
  const found = ROUTES.map(([pattern, page]) => [path.match(pattern), page]).find(([m]) => m);
  main.replaceChildren();
  main.setAttribute("aria-busy", "true");
  document.querySelectorAll("nav a").forEach((a) => {
    a.toggleAttribute("aria-current", path.startsWith(a.getAttribute("href").slice(1)));
  });
  if (!found) {
    main.append(h("h1", {}, "Not found"), h("p", {}, `No page at ${path}.`));
    main.removeAttribute("aria-busy");
    return;
  }
  const [match, page] = found;
  try {
    await page.render({ main, id: match[1], params, signal });
  } catch (error) {
    if (signal.aborted) return;
    if (error instanceof ApiError && error.status === 401) return; // the key prompt is shown
    main.append(failure(error));
  } finally {
    if (!signal.aborted) {
      main.removeAttribute("aria-busy");
      performance.mark("layerswap:rendered", { detail: path }); // read by bench/console.py
    }
  }
  main.focus({ preventScroll: true });
}

/** With auth on: ask for a key (kept in this tab's sessionStorage), then show the page. */
function askForKey(message) {
  const dialog = document.getElementById("key-dialog");
  const input = dialog.querySelector("input");
  dialog.querySelector(".why").textContent = message;
  input.value = "";
  if (!dialog.open) dialog.showModal();
  input.focus();
}

function setUp() {
  const dialog = document.getElementById("key-dialog");
  dialog.querySelector("form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = dialog.querySelector("input").value.trim();
    if (!key) return;
    rememberKey(key);
    dialog.close();
    updateSignOut();
    show();
  });
  dialog.addEventListener("cancel", (event) => event.preventDefault()); // no data without a key
  window.addEventListener("layerswap:unauthorized", () => {
    if (current) current.abort();
    main.replaceChildren(h("p", { class: "muted" }, "An API key is needed to see this page."));
    askForKey(storedKey() ? "That key was refused. Enter another API key." : "This service needs an API key.");
  });
  document.getElementById("sign-out").addEventListener("click", () => {
    forgetKey();
    updateSignOut();
    show();
  });
  window.addEventListener("hashchange", show);
  // Leaving the page (or its going into the back/forward cache) closes its streams: open
  // ones would hold connections the next page needs. Back again, it is drawn afresh.
  window.addEventListener("pagehide", () => current && current.abort());
  window.addEventListener("pageshow", (event) => event.persisted && show());
  updateSignOut();
  show();
}

function updateSignOut() {
  document.getElementById("sign-out").hidden = !storedKey();
}

setUp();
