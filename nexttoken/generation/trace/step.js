// One step of a trace as DOM nodes: the title (the chosen token, its rank and probability), the draw, a card of
// bars per stage (the model's candidates, then after each processor, the chosen token in red) and the rows of
// the stop decisions. Shared by the explain page (page.py inlines this file) and the server's chat page (served
// as /webui/trace-step.js). Token texts are set as text, never as markup.
"use strict";
const TraceStep = (function () {
  const el = (tag, cls, text) => {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  };
  const fmt = (x, d) => (x === null || x === undefined) ? "-" : Number(x).toFixed(d === undefined ? 4 : d);
  const tokenText = (trace, id) => {
    const texts = trace.token_texts || {};
    return (String(id) in texts) ? texts[String(id)] : "#" + id;
  };

  function bars(trace, title, stats, top, chosen) {
    const card = el("div", "stage");
    card.appendChild(el("h3", null, title));
    card.appendChild(el("div", "stats", stats));
    top.ids.forEach((id, k) => {
      const row = el("div", "bar-row" + (id === chosen ? " chosen" : ""));
      row.dataset.tokenId = id;
      row.appendChild(el("span", "label", tokenText(trace, id)));
      const track = el("span", "track"), bar = el("span", "bar");
      bar.style.display = "block";
      bar.style.width = (100 * (top.probs[k] || 0)).toFixed(2) + "%";
      track.appendChild(bar);
      row.appendChild(track);
      row.appendChild(el("span", "value", fmt(top.probs[k], 3)));
      card.appendChild(row);
    });
    return card;
  }

  /** "step i: chose ..." for step i of the trace. */
  function title(trace, i) {
    const c = trace.steps[i].chosen;
    return "step " + i + ": chose " + JSON.stringify(tokenText(trace, c.id)) + " (id " + c.id + ", rank " + c.rank +
      ", p " + fmt(c.prob) + "; under the raw logits rank " + c.raw_rank + ", p " + fmt(c.raw_prob) + ")";
  }

  /** The sampler's line: greedy or a draw, its seed and the generator's state before the draw. */
  function draw(step) {
    const sm = step.sampler || {};
    return "sampler: " + sm.kind + (sm.greedy ? " (argmax)" : " (a draw)") +
      (sm.seed !== null && sm.seed !== undefined ? ", seed " + sm.seed : "") + (sm.state ? ", generator state " + sm.state : "");
  }

  /** The cards of step i: the model's candidates, then after each processor in order. */
  function cards(trace, i) {
    const s = trace.steps[i], chosen = s.chosen.id;
    const out = [bars(trace, "model (raw)", "entropy " + fmt(s.raw.entropy), s.raw, chosen)];
    (s.stages || []).forEach(st => {
      const stats = "changed " + st.changed + ", masked " + st.masked + ", mass moved " + fmt(st.mass_moved) +
        ", entropy " + fmt(st.entropy_before) + " -> " + fmt(st.entropy_after) + ", " + fmt(st.ms, 3) + " ms";
      out.push(bars(trace, "after " + st.name, stats, st.top, chosen));
    });
    return out;
  }

  /** Table rows (<tr>) of step i's stop decisions, then its notes (speculation, ...). */
  function stopRows(trace, i) {
    const s = trace.steps[i], rows = [];
    (s.stop || []).forEach(d => {
      const tr = el("tr");
      tr.appendChild(el("td", null, d.name));
      tr.appendChild(el("td", d.stop ? "yes" : null, d.stop ? "stop" : "no"));
      tr.appendChild(el("td", null, d.detail === null || d.detail === undefined ? "" : String(d.detail)));
      rows.push(tr);
    });
    Object.entries(s.notes || {}).forEach(([name, value]) => {
      const tr = el("tr");
      tr.appendChild(el("td", null, name));
      tr.appendChild(el("td", null, "note"));
      tr.appendChild(el("td", null, JSON.stringify(value)));
      rows.push(tr);
    });
    return rows;
  }

  return { fmt, tokenText, title, draw, cards, stopRows };
})();
