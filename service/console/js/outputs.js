// A stored output's files (GET /v1/artifacts/{id}/files): each with its size and a download
// link, and its model card (README.md) rendered from Markdown into text nodes.

import { api, ApiError, storedKey } from "./api.js";
import { bytes, h } from "./dom.js";
import { frontMatter, markdown } from "./markdown.js";

const CARD = "README.md";

/** The files section, and the model card's section when the output has one. */
export async function outputSections(artifactId, signal) {
  let listing;
  try {
    listing = await api(`/v1/artifacts/${artifactId}/files`, { signal });
  } catch (error) {
    if (!(error instanceof ApiError) || error.status !== 404) throw error;
    return [h("section", { class: "card", id: "files" }, h("h2", {}, "Files"),
      h("p", { class: "muted" }, error.message))]; // deleted: the row stays for lineage
  }
  const sections = [filesSection(artifactId, listing.files)];
  if (listing.files.some((file) => file.name === CARD && file.size !== null)) {
    const text = await api(fileUrl(artifactId, CARD), { signal, accept: "text/markdown" });
    sections.unshift(cardSection(String(text)));
  }
  return sections;
}

function fileUrl(artifactId, name) {
  return `/v1/artifacts/${artifactId}/files/${name.split("/").map(encodeURIComponent).join("/")}`;
}

function filesSection(artifactId, files) {
  const total = files.reduce((sum, file) => sum + (file.size || 0), 0);
  const rows = files.map((file) => h("tr", { "data-file": file.name },
    h("td", {}, file.size === null ? file.name : download(artifactId, file.name)),
    h("td", { class: "num", "data-size": file.size ?? "" }, file.size === null ? "missing" : bytes(file.size)),
    h("td", { class: "mono" }, file.sha256)));
  const head = h("tr", {}, ["file", "size", "sha256"].map((t) => h("th", { scope: "col" }, t)));
  return h("section", { class: "card", id: "files" }, h("h2", {}, "Files"),
    h("p", { class: "muted" }, `${files.length} files, ${bytes(total)}`),
    h("table", { class: "files" }, h("thead", {}, head), h("tbody", {}, rows)));
}

/** A link that downloads the file: a plain one without auth; with a key (which a link cannot
 * send) fetched with it, then saved from memory. */
function download(artifactId, name) {
  const url = fileUrl(artifactId, name);
  const anchor = h("a", { href: url, download: name.split("/").pop() }, name);
  anchor.addEventListener("click", async (event) => {
    const key = storedKey();
    if (!key) return;
    event.preventDefault();
    const response = await fetch(url, { headers: { Authorization: "Bearer " + key } });
    if (!response.ok) return;
    const saved = URL.createObjectURL(await response.blob());
    const save = h("a", { href: saved, download: name.split("/").pop() });
    save.click();
    setTimeout(() => URL.revokeObjectURL(saved), 60000);
  });
  return anchor;
}

function cardSection(text) {
  const { meta, body } = frontMatter(text);
  return h("section", { class: "card", id: "model-card" }, h("h2", {}, "Model card"),
    meta ? h("details", {}, h("summary", {}, "metadata"), h("pre", {}, meta)) : "",
    h("div", { class: "markdown" }, markdown(body)));
}
