// relayrl view: the timeline of the last few trainer steps across the services (/api/timeline,
// deploy/inspect/timeline.py). A lane per process, a row per overlap; the spans of the samples those steps consumed
// are highlighted. Span names go into the page as textContent.
"use strict";

const TIMELINE_COLOURS = { driver: "#8fb3e8", rollout: "#9bd3a4", reward: "#f2c48d", buffer: "#c9b3e6", trainer: "#f0a3a3" };
const ROW_PX = 16;

function timelineLane(lane, scale) {
  const rows = el("div", { class: "tl-rows" });
  rows.style.height = `${lane.rows * ROW_PX}px`;
  for (const span of lane.spans) {
    const bar = el("div", {
      class: "tl-span" + (span.consumed ? " consumed" : ""),
      title: `${span.name}  ${span.dur_ms.toFixed(2)} ms from ${span.start_ms.toFixed(2)} ms  trace ${span.trace_id.slice(0, 8)}`,
      text: span.name,
    });
    bar.style.left = `${span.start_ms * scale}%`;
    bar.style.width = `max(2px, ${span.dur_ms * scale}%)`;
    bar.style.top = `${span.row * ROW_PX}px`;
    bar.style.backgroundColor = TIMELINE_COLOURS[lane.service] || "#d5dae3";
    rows.append(bar);
  }
  return el("div", { class: "tl-lane" }, el("div", { class: "tl-name", text: `${lane.service} (pid ${lane.pid})` }), rows);
}

async function showTimeline() {
  const box = document.getElementById("timeline");
  const steps = document.getElementById("timeline-steps").value || 3;
  const data = await getJSON(`/api/timeline?steps=${encodeURIComponent(steps)}`);
  box.replaceChildren();
  box.hidden = false;
  if (!data.lanes.length) {
    box.append(el("p", { class: "empty", text: data.note }));
    return;
  }
  const scale = 100 / Math.max(data.window_ms, 1e-3);
  const marks = data.steps.map((s) => `step ${s.first_step === s.last_step ? s.first_step : `${s.first_step}-${s.last_step}`}` +
                                      ` (${s.samples} traced samples) at ${s.start_ms.toFixed(1)}-${s.end_ms.toFixed(1)} ms`);
  box.append(el("p", { class: "meta", text: `${data.window_ms.toFixed(1)} ms; ${marks.join("; ")}; highlighted: ` +
                                            "the spans of the samples these steps trained on" }));
  for (const lane of data.lanes) box.append(timelineLane(lane, scale));
}

document.getElementById("timeline-show").addEventListener("click", () => {
  showTimeline().catch((error) => { document.getElementById("timeline").replaceChildren(el("p", { class: "empty", text: String(error) })); });
});
