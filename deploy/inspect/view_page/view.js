// relayrl view: the page over /api/run and /api/groups (deploy/inspect/view.py). Every text from the run goes into the
// page as textContent, never as HTML: completions are whatever the policy wrote.
"use strict";

const PAGE_SIZE = 20;
const state = { colour: "logprob", run: null, panes: [] };

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) if (child != null) node.append(child);
  return node;
}

async function getJSON(url) {
  const reply = await fetch(url);
  if (!reply.ok) throw new Error(`${url}: ${reply.status}`);
  return reply.json();
}

const plural = (n, word) => `${n} ${word}${n === 1 ? "" : "s"}`;
const fmt = (x, digits = 2) => (x == null ? "–" : Number(x).toFixed(digits));
const signed = (x) => (x == null ? "–" : (x > 0 ? "+" : "") + Number(x).toFixed(2));

// ------------------------------------------------------------------ token colours

function versionColour(version) {
  return `hsl(${(version * 67) % 360}, 70%, 84%)`;
}

function tokenColour(sample, i) {
  if (state.colour === "mask") return sample.loss_mask[i] ? "#cfe3ff" : "#e4e6ea";
  if (state.colour === "version") return versionColour(sample.versions[i]);
  const p = Math.exp(sample.logprobs[i]);  // red (unlikely) .. green (likely)
  return `hsl(${Math.round(120 * p)}, 75%, 80%)`;
}

function tokenText(sample, i) {
  const text = sample.tokens ? sample.tokens[i] : `[${sample.ids[i]}]`;
  return text.replace(/\n/g, "↵\n");
}

function tokenStrip(sample) {
  const strip = el("div", { class: "tokens" });
  for (let i = 0; i < sample.ids.length; i++) {
    const lp = sample.logprobs[i];
    const span = el("span", {
      class: "tok" + (sample.loss_mask[i] ? "" : " unmasked"),
      title: `#${i}  id ${sample.ids[i]}  logprob ${fmt(lp, 3)} (p ${fmt(Math.exp(lp), 3)})  ` +
             `version ${sample.versions[i]}  loss mask ${sample.loss_mask[i]}`,
      text: tokenText(sample, i),
    });
    span.style.backgroundColor = tokenColour(sample, i);
    strip.append(span);
  }
  return strip;
}

function renderLegend() {
  const legend = document.getElementById("legend");
  legend.replaceChildren();
  const swatch = (colour, text) => {
    const s = el("span", { class: "swatch", text });
    s.style.backgroundColor = colour;
    return s;
  };
  if (state.colour === "mask") {
    legend.append(swatch("#cfe3ff", "1: trained on"), swatch("#e4e6ea", "0: not trained (environment)"));
  } else if (state.colour === "version") {
    const shown = new Set();
    for (const pane of state.panes) for (const g of pane.groups) for (const s of g.samples) s.versions.forEach((v) => shown.add(v));
    legend.append("version:");
    [...shown].sort((a, b) => a - b).slice(0, 24).forEach((v) => legend.append(swatch(versionColour(v), `v${v}`)));
  } else {
    legend.append("p = exp(logprob):");
    for (const p of [0, 0.25, 0.5, 0.75, 1]) legend.append(swatch(`hsl(${120 * p}, 75%, 80%)`, p.toFixed(2)));
  }
}

// ------------------------------------------------------------------ groups, samples, turns

function renderTurns(turns) {
  const box = el("div", { class: "turns" });
  for (const turn of turns) {
    if (turn.role === "assistant") {
      const line = el("div", { class: "turn assistant" }, el("span", { class: "role", text: "policy" }));
      if (turn.content) line.append(turn.content);
      for (const call of turn.tool_calls || []) {
        line.append(el("span", { class: "call", text: `${call.name}(${JSON.stringify(call.arguments)})` }));
      }
      if (!turn.content && !(turn.tool_calls || []).length) line.append(turn.text);
      box.append(line);
    } else {
      for (const message of turn.messages || []) {
        box.append(el("div", { class: "turn environment" },
          el("span", { class: "role", text: message.name ? `${message.role} ${message.name}` : message.role }),
          message.content));
      }
      box.append(el("div", { class: "meta", text: `reward ${fmt(turn.reward)}${turn.done ? " · done" : ""}` }));
    }
  }
  return box;
}

function renderSample(sample, index) {
  const versions = sample.min_version === sample.max_version ? `v${sample.max_version}` :
    `v${sample.min_version}–${sample.max_version}`;
  const head = el("div", { class: "sample-head" },
    el("span", { text: `#${sample.sample_id.split("/").pop() || index}` }),
    el("span", { class: "reward", text: `reward ${fmt(sample.reward)}` }),
    el("span", { class: "advantage", text: `advantage ${signed(sample.advantage)}` }),
    el("span", { class: `status status-${sample.status}`, text: sample.status }),
    el("span", { class: "staleness", text: `staleness ≥ ${sample.staleness ?? "–"}` }),
    el("span", { text: versions }),
    el("span", { text: `${sample.ids.length} tokens` }),
    el("span", { text: `mean logprob ${fmt(sample.mean_logprob)}` }));
  const details = Object.entries(sample.reward_details || {});
  if (details.length) head.append(el("span", { text: details.map(([k, v]) => `${k} ${fmt(v)}`).join(", ") }));
  if (sample.reason && sample.status !== "completed") head.append(el("span", { text: sample.reason }));
  const box = el("div", { class: "sample", "data-sample-id": sample.sample_id }, head);
  if (sample.turns) box.append(renderTurns(sample.turns));
  box.append(tokenStrip(sample));
  return box;
}

function renderGroup(group) {
  const answer = group.prompt.metadata && group.prompt.metadata.answer;
  const head = el("div", { class: "group-head" },
    el("b", { text: group.prompt_id }),
    el("span", { text: group.kind === "episodes" ? "episodes" : "completions" }),
    el("span", { text: `policy v${group.version}` }),
    el("span", { text: `trainer v${group.trainer_version} · served v${group.served_version} when stored` }),
    el("span", { text: `group mean reward ${fmt(group.reward_mean)}` }));
  if (group.hidden) head.append(el("span", { text: `${group.hidden} of ${group.samples.length + group.hidden} hidden by the filters` }));
  const card = el("article", { class: "group", "data-group-id": group.group_id }, head);
  const opening = group.prompt.messages;
  const promptText = opening ? opening.map((m) => `${m.role}: ${m.content}`).join("\n") : group.prompt.text;
  card.append(el("div", { class: "prompt", text: promptText }));
  for (const image of group.prompt.images || []) {  // a vision-language model's prompt images, beside its completions
    card.append(el("img", { class: "prompt-image", alt: "prompt image", src: `data:${image.media_type};base64,${image.data}` }));
  }
  if (answer != null) card.append(el("div", { class: "meta", text: `answer: ${answer}` }));
  group.samples.forEach((s, i) => card.append(renderSample(s, i)));
  return card;
}

// ------------------------------------------------------------------ panes (one step each)

function filterQuery() {
  const params = new URLSearchParams();
  for (const [id, key] of [["min-reward", "min_reward"], ["max-reward", "max_reward"],
                           ["min-staleness", "min_staleness"], ["max-staleness", "max_staleness"]]) {
    const value = document.getElementById(id).value;
    if (value !== "") params.set(key, value);
  }
  const boxes = [...document.querySelectorAll("#statuses input")];
  if (boxes.some((b) => !b.checked)) params.set("status", boxes.filter((b) => b.checked).map((b) => b.value).join(","));
  const text = document.getElementById("search").value.trim();
  if (text) params.set("q", text);
  return params;
}

class Pane {
  constructor(node, pick) {
    this.node = node;
    this.pick = pick;  // which step a fresh pane shows: "last" or "first"
    this.version = null;
    this.groups = [];
    this.select = el("select", { class: "step" });
    this.select.addEventListener("change", () => { this.version = this.select.value; this.load(); });
    const step = (delta) => () => {
      const i = this.select.selectedIndex + delta;
      if (i >= 0 && i < this.select.options.length) { this.select.selectedIndex = i; this.select.dispatchEvent(new Event("change")); }
    };
    this.count = el("span", { class: "pane-count" });
    this.list = el("div", { class: "groups" });
    this.more = el("button", { class: "more", type: "button", text: "more groups" });
    this.more.addEventListener("click", () => this.load(true));
    node.replaceChildren(el("div", { class: "pane-head" }, el("label", { text: "step " }), this.select,
      el("button", { type: "button", text: "◀", title: "previous step" }), el("button", { type: "button", text: "▶", title: "next step" }),
      this.count), this.list, this.more);
    const [prev, next] = node.querySelectorAll(".pane-head button");
    prev.addEventListener("click", step(-1));
    next.addEventListener("click", step(1));
  }

  setSteps(steps) {
    const keep = this.version;
    this.select.replaceChildren(el("option", { value: "", text: "every step" }));
    for (const s of steps) {
      this.select.append(el("option", { value: String(s.version),
        text: `v${s.version} · ${plural(s.groups, "group")} · ${plural(s.samples, "sample")} · mean reward ${fmt(s.reward_mean)}` }));
    }
    const versions = steps.map((s) => String(s.version));
    this.version = versions.includes(keep) ? keep : (steps.length ? (this.pick === "last" ? versions.at(-1) : versions[0]) : "");
    this.select.value = this.version;
  }

  async load(append = false) {
    const params = filterQuery();
    if (this.version !== "" && this.version != null) params.set("version", this.version);
    params.set("offset", append ? this.groups.length : 0);
    params.set("limit", PAGE_SIZE);
    const reply = await getJSON(`/api/groups?${params}`);
    this.groups = append ? this.groups.concat(reply.groups) : reply.groups;
    this.total = reply.total;
    this.render();
  }

  render() {
    this.list.replaceChildren(...this.groups.map(renderGroup));
    if (!this.groups.length) this.list.append(el("div", { class: "empty", text: "no group of this step passes the filters" }));
    const samples = this.groups.reduce((n, g) => n + g.samples.length, 0);
    this.count.textContent = `${plural(this.total, "group")} match${this.total === 1 ? "es" : ""} · showing ${this.groups.length} (${plural(samples, "sample")})`;
    this.more.hidden = this.groups.length >= this.total;
    renderLegend();
  }
}

// ------------------------------------------------------------------ the run

function renderRun(run) {
  document.getElementById("run-name").textContent = run.name;
  const facts = run.exists
    ? [plural(run.groups, "group"), plural(run.samples, "sample"), plural(run.steps.length, "step"),
       run.stride > 1 ? `the log keeps one group in ${run.stride}` : "the log keeps every group", `advantage: ${run.advantage}`,
       run.staleness_range ? `staleness ${run.staleness_range[0]}–${run.staleness_range[1]}` : null,
       run.log].filter(Boolean)
    : [`no trajectory log yet: ${run.log}`];
  document.getElementById("run-facts").textContent = facts.join(" · ");
  const statuses = document.getElementById("statuses");
  const known = new Set([...statuses.querySelectorAll("input")].map((b) => b.value));
  for (const status of run.statuses) {
    if (known.has(status)) continue;
    const box = el("input", { type: "checkbox", value: status });
    box.checked = true;
    box.addEventListener("change", reloadPanes);
    statuses.append(el("label", {}, box, ` ${status}`));
  }
  for (const pane of state.panes) pane.setSteps(run.steps);
}

async function refresh() {
  state.run = await getJSON("/api/run");
  renderRun(state.run);
  await reloadPanes();
}

async function reloadPanes() {
  await Promise.all(state.panes.filter((p) => !p.node.hidden).map((p) => p.load()));
}

function debounce(fn, ms) {
  let timer = null;
  return () => { clearTimeout(timer); timer = setTimeout(fn, ms); };
}

function start() {
  state.panes = [new Pane(document.getElementById("pane-a"), "last"), new Pane(document.getElementById("pane-b"), "first")];
  for (const radio of document.querySelectorAll("input[name=colour]")) {
    radio.addEventListener("change", () => { state.colour = radio.value; state.panes.forEach((p) => p.render()); });
  }
  const later = debounce(reloadPanes, 250);
  for (const id of ["min-reward", "max-reward", "min-staleness", "max-staleness", "search"]) {
    document.getElementById(id).addEventListener("input", later);
  }
  document.getElementById("clear").addEventListener("click", () => {
    for (const id of ["min-reward", "max-reward", "min-staleness", "max-staleness", "search"]) document.getElementById(id).value = "";
    document.querySelectorAll("#statuses input").forEach((b) => { b.checked = true; });
    reloadPanes();
  });
  document.getElementById("compare").addEventListener("change", (event) => {
    const on = event.target.checked;
    document.getElementById("pane-b").hidden = !on;
    document.getElementById("panes").classList.toggle("compare", on);
    if (on) state.panes[1].load();
  });
  document.getElementById("refresh").addEventListener("click", refresh);
  refresh();
}

start();
