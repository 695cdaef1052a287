// nexttoken's chat page. It speaks only the public API (client.js): GET /v1/models, POST /v1/chat/completions
// with "stream": true (server-sent events read from fetch, stopped with an AbortController), and, for "why this
// token", GET /v1/traces/{id}.json. Conversations and their options live in this browser's localStorage.
// Model text is only ever set as text (textContent, or Markdown.render's text nodes), never as markup.
"use strict";
(function () {
  const STORE = "nexttoken.webui.conversations";
  const $ = id => document.getElementById(id);
  const el = (tag, cls, text) => {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = text;
    return e;
  };
  const button = (cls, text, title, onClick) => {
    const b = el("button", cls, text);
    b.type = "button";
    if (title) b.title = title;
    b.addEventListener("click", onClick);
    return b;
  };

  // ---- state ------------------------------------------------------------------------------------------------
  let state = load();
  let model = null;               // the served model's id, from /v1/models
  let running = null;             // {controller, conv, msg} while an answer streams
  let attached = [];              // the images the next message carries, as data: URLs (uploaded or pasted)
  const traces = new Map();       // trace id -> its JSON (or a Promise of it); not stored: the server keeps them

  function newConversation(options) {
    return { id: "c" + Date.now().toString(36) + Math.random().toString(36).slice(2, 6), title: "New chat",
      messages: [], options: options ? JSON.parse(JSON.stringify(options)) : { trace: true } };
  }
  function load() {
    try {
      const s = JSON.parse(localStorage.getItem(STORE));
      if (s && Array.isArray(s.conversations) && s.conversations.length) return s;
    } catch (e) { /* a damaged store starts afresh */ }
    const c = newConversation();
    return { conversations: [c], current: c.id };
  }
  function save() {
    try { localStorage.setItem(STORE, JSON.stringify(state)); } catch (e) { /* full: keep going in memory */ }
  }
  const conv = () => state.conversations.find(c => c.id === state.current) || state.conversations[0];

  // ---- the API ----------------------------------------------------------------------------------------------
  let keyWaiters = [];
  function askForKey(message) {  // resolves once the user has given a key
    $("key-dialog").hidden = false;
    $("key-error").hidden = !message;
    $("key-error").textContent = message || "";
    $("key-input").focus();
    return new Promise(resolve => keyWaiters.push(resolve));
  }
  async function loadModel() {
    const response = await Client.api("/v1/models");
    if (!response.ok) throw new Error(await Client.errorOf(response));
    const data = (await response.json()).data || [];
    model = data.length ? data[0].id : null;
    $("model").textContent = model || "(no model)";
    $("forget-key").hidden = !Client.key();
    showDefaults(data.length ? data[0].generation_defaults : null);
  }

  /** A blank field sends nothing and the server applies its default (the model's generation_config.json, else
   * OpenAI's): each blank field shows the value that will apply, as the model card says. */
  function showDefaults(defaults) {
    if (!defaults) return;
    const fromModel = new Set(defaults.from_model || []);
    Client.NUMBERS.forEach(name => {
      if (!(name in defaults)) return;
      const v = defaults[name];
      const text = v === null || v === undefined ? (name === "max_tokens" ? "rest of context" : "off") : String(v);
      $("opt-" + name).placeholder = text + (fromModel.has(name) ? " (model)" : " (default)");
    });
  }

  /** Stream an answer into `msg` (an assistant message already in the conversation). */
  async function generate(c, msg) {
    const upto = c.messages.indexOf(msg);
    let body;
    try { body = Client.requestBody(c, upto, model); } catch (e) {  // regenerate or edit with options that cannot be sent
      showOptionsError(e.message);
      Object.assign(msg, { state: "error", error: e.message });
      save();
      render();
      return;
    }
    showOptionsError(null);
    Object.assign(msg, { content: "", reasoning: "", tool_calls: [], state: "streaming", finish_reason: null,
      stats: null, trace: null, error: null, deltas: 0 });
    const controller = new AbortController();
    running = { controller, conv: c, msg };
    setRunning(true);
    render();
    const t0 = performance.now();
    let first = null, last = null, usage = null;
    const seen = () => { last = performance.now(); if (first === null) first = last; };
    try {
      const response = await Client.api("/v1/chat/completions", { method: "POST", body: JSON.stringify(body),
        signal: controller.signal });
      if (!response.ok) throw new Error(await Client.errorOf(response));
      for await (const chunk of Client.events(response)) {
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const d = choice.delta || {};
          const reasoning = d.reasoning_content || d.reasoning;  // a reasoning model's thinking, when sent
          if (reasoning) { msg.reasoning += reasoning; seen(); }
          if (d.content) { msg.content += d.content; seen(); }
          (d.tool_calls || []).forEach(call => { mergeCall(msg, call); seen(); });
          if (choice.finish_reason) msg.finish_reason = choice.finish_reason;
          if (choice.trace) msg.trace = { id: choice.trace.id, url: choice.trace.url, json_url: choice.trace.json_url };
        }
        msg.deltas++;
        scheduleRender(msg);
      }
      msg.state = "done";
    } catch (e) {
      if (controller.signal.aborted) { msg.state = "stopped"; msg.finish_reason = "stopped"; }
      else { msg.state = "error"; msg.error = e.message; }
    }
    const end = performance.now();
    const tokens = usage ? usage.completion_tokens : null;
    msg.stats = { tokens, ttft_ms: first === null ? null : first - t0,
      tokens_per_s: tokens && tokens > 1 && last > first ? (tokens - 1) / ((last - first) / 1000) : null,
      ms: end - t0 };
    running = null;
    if (pending) { cancelAnimationFrame(pending); pending = null; }
    setRunning(false);
    save();
    render();
    document.body.dataset.answers = +(document.body.dataset.answers || 0) + 1;  // answers ended on this page
  }

  function mergeCall(msg, call) {  // a streamed tool call: its id and name first, then its argument text
    const i = call.index === undefined ? msg.tool_calls.length : call.index;
    const have = msg.tool_calls[i] || (msg.tool_calls[i] = { id: call.id, type: "function", function: { name: "", arguments: "" } });
    if (call.id) have.id = call.id;
    const f = call.function || {};
    if (f.name) have.function.name += f.name;
    if (f.arguments) have.function.arguments += f.arguments;
  }

  function stop() { if (running) running.controller.abort(); }

  function setRunning(on) {
    $("send").hidden = on;
    $("stop").hidden = !on;
    document.body.dataset.running = on ? "1" : "";
  }

  // ---- actions ----------------------------------------------------------------------------------------------
  /** Send the user's text with the conversation's options; false (the text stays in the box) when the options
      cannot make a request (the options panel says why). */
  function send(text) {
    if (running || (!text.trim() && !attached.length)) return false;
    const c = conv();
    try { Client.requestBody(c, c.messages.length, model); } catch (e) { showOptionsError(e.message); return false; }
    const user = { role: "user", content: text };
    if (attached.length) user.images = attached;
    attached = [];
    renderAttached();
    c.messages.push(user);
    if (c.title === "New chat") c.title = (text.trim() || "(image)").replace(/\s+/g, " ").slice(0, 48);
    const msg = { role: "assistant", content: "" };
    c.messages.push(msg);
    save();
    generate(c, msg);
    return true;
  }
  function regenerate(c, msg) {
    if (running) return;
    generate(c, msg);
  }
  function edit(c, i, node) {  // the message becomes a text box: save it (and, for a user message, send again)
    if (running) return;
    const m = c.messages[i];
    const box = el("textarea", "edit-box");
    box.value = m.content || "";
    box.rows = Math.min(12, Math.max(2, box.value.split("\n").length));
    const bar = el("div", "actions");
    const done = resend => {
      m.content = box.value;
      if (resend && m.role === "user") {
        c.messages.splice(i + 1);
        const msg = { role: "assistant", content: "" };
        c.messages.push(msg);
        save();
        generate(c, msg);
      } else { save(); render(); }
    };
    bar.appendChild(button("primary save-send", m.role === "user" ? "Save & send" : "Save", null, () => done(true)));
    bar.appendChild(button("cancel", "Cancel", null, render));
    const body = node.querySelector(".body");
    body.replaceChildren(box, bar);
    box.addEventListener("keydown", e => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); done(true); }
      if (e.key === "Escape") { e.preventDefault(); render(); }
    });
    box.focus();
  }
  async function copy(text, b) {
    try { await navigator.clipboard.writeText(text); } catch (e) {
      const t = el("textarea"); t.value = text; document.body.appendChild(t); t.select();
      document.execCommand("copy"); t.remove();
    }
    b.textContent = "copied";
    setTimeout(() => { b.textContent = "copy"; }, 1200);
  }
  function exportConversation() {
    const c = conv();
    const blob = new Blob([JSON.stringify({ model, ...c }, null, 2)], { type: "application/json" });
    const a = el("a");
    a.href = URL.createObjectURL(blob);
    a.download = "nexttoken-chat-" + c.id + ".json";
    document.body.appendChild(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(a.href), 1000);
  }

  // ---- images: uploaded with the button or pasted into the message box ---------------------------------------
  function attach(files) {
    [...files].filter(f => f.type.startsWith("image/")).forEach(file => {
      const reader = new FileReader();
      reader.onload = () => { attached.push(reader.result); renderAttached(); };
      reader.readAsDataURL(file);
    });
  }
  function renderAttached() {
    const box = $("attached");
    box.hidden = !attached.length;
    box.replaceChildren(...attached.map((url, i) => {
      const t = el("div", "thumb");
      const img = el("img");
      img.src = url;
      img.alt = "attached image " + (i + 1);
      t.appendChild(img);
      t.appendChild(button("remove", "\u00d7", "remove this image", () => { attached.splice(i, 1); renderAttached(); }));
      return t;
    }));
    document.body.dataset.attached = attached.length;
  }

  // ---- "why this token" -------------------------------------------------------------------------------------
  function getTrace(info) {
    if (!traces.has(info.id)) {
      traces.set(info.id, Client.api(info.json_url).then(async r => {
        if (!r.ok) throw new Error(await Client.errorOf(r));
        return r.json();
      }));
    }
    return traces.get(info.id);
  }
  async function showTokens(m, node) {
    const box = node.querySelector(".why");
    const toggle = node.querySelector(".why-toggle");
    if (!box.hidden) {
      box.hidden = true;
      node.classList.remove("why-open");
      toggle.textContent = "why this token?";
      return;
    }
    box.hidden = false;
    node.classList.add("why-open");  // the tokens take the text's place while they are shown
    toggle.textContent = "show the text";
    box.replaceChildren(el("div", "note", "loading the trace ..."));
    let trace;
    try { trace = await getTrace(m.trace); } catch (e) {
      box.replaceChildren(el("div", "error", "the trace is not available: " + e.message));
      return;
    }
    const strip = el("div", "strip");
    trace.steps.forEach((s, i) => {
      const shown = s.text ? s.text : TraceStep.tokenText(trace, s.chosen.id);
      const t = el("span", "tok", shown);
      t.dataset.step = i;
      t.tabIndex = 0;
      t.style.background = "rgba(220, 60, 40, " + (0.08 + 0.8 * (1 - s.chosen.prob)).toFixed(3) + ")";
      t.title = "step " + i + ": p=" + TraceStep.fmt(s.chosen.prob) + ", rank " + s.chosen.rank;
      t.addEventListener("click", () => step(trace, i, box));
      t.addEventListener("keydown", e => { if (e.key === "Enter") step(trace, i, box); });
      strip.appendChild(t);
    });
    const help = el("div", "note", "each token shaded by how unsure the choice was (darker: less likely); click one to see why it came out. ");
    if (!Client.key()) {  // a link cannot carry the key: with one, the server's page would be a 401
      const full = el("a", "explain-link", "the full explain page");
      full.href = m.trace.url;
      full.target = "_blank";
      help.appendChild(full);
    }
    box.replaceChildren(help, strip, el("div", "detail"));
  }

  /** One step of the trace, inline: the candidates before and after each processor, the draw, the stops (drawn
      by the explain page's own script, TraceStep). */
  function step(trace, i, box) {
    box.querySelectorAll(".tok.sel").forEach(t => t.classList.remove("sel"));
    box.querySelector('.tok[data-step="' + i + '"]').classList.add("sel");
    const detail = box.querySelector(".detail");
    detail.dataset.step = i;
    const cards = el("div", "cards");
    cards.replaceChildren(...TraceStep.cards(trace, i));
    const table = el("table", "stops");
    const head = el("tr");
    ["condition", "stops?", "detail"].forEach(h => head.appendChild(el("th", null, h)));
    table.replaceChildren(head, ...TraceStep.stopRows(trace, i));
    const close = button("link close-step", "close", "hide this step", () => {
      detail.replaceChildren();
      delete detail.dataset.step;
      box.querySelectorAll(".tok.sel").forEach(t => t.classList.remove("sel"));
    });
    detail.replaceChildren(el("div", "step-title", TraceStep.title(trace, i)),
      el("div", "draw", TraceStep.draw(trace.steps[i])), cards, table, close);
  }

  // ---- rendering --------------------------------------------------------------------------------------------
  let pending = null;
  function scheduleRender(msg) {  // at most one repaint of the streaming message per frame
    if (pending) return;
    pending = requestAnimationFrame(() => { pending = null; renderStreaming(msg); });
  }
  function renderStreaming(msg) {
    if (msg.state !== "streaming") return;  // finished meanwhile: render() has drawn it (and an edit box may be open)
    const c = conv(), i = c.messages.indexOf(msg);
    const node = document.querySelector('#messages .msg[data-index="' + i + '"]');
    if (!node) return;
    node.replaceWith(messageNode(c, i));
  }

  function messageNode(c, i) {
    const m = c.messages[i];
    const node = el("div", "msg " + m.role);
    node.dataset.index = i;
    node.dataset.role = m.role;
    if (m.role === "assistant") node.dataset.state = m.state || "done";
    node.dataset.deltas = m.deltas || 0;
    node.appendChild(el("div", "who", m.role === "user" ? "you" : m.role));
    const body = el("div", "body");
    if (m.role === "assistant") {
      if (m.reasoning) {
        const fold = el("details", "reasoning");
        fold.appendChild(el("summary", null, m.state === "streaming" && !m.content ? "thinking ..." : "reasoning"));
        fold.appendChild(el("div", "reasoning-text", m.reasoning));
        body.appendChild(fold);
      }
      const content = el("div", "content markdown");
      content.appendChild(Markdown.render(m.content || ""));
      body.appendChild(content);
      (m.tool_calls || []).forEach(call => {
        const box = el("div", "tool-call");
        const f = call.function || {};
        box.appendChild(el("div", "call-name", (f.name || "?") + "(...)"));
        let args = f.arguments || "";
        try { args = JSON.stringify(JSON.parse(args), null, 2); } catch (e) { /* still streaming, or not JSON */ }
        box.appendChild(el("pre", "call-args", args));
        if (call.id) box.appendChild(el("div", "call-id", call.id));
        body.appendChild(box);
      });
      if (m.state === "streaming" && !m.content && !m.reasoning && !(m.tool_calls || []).length) body.appendChild(el("div", "note", "..."));
      if (m.error) body.appendChild(el("div", "error", m.error));
    } else {
      if (m.images && m.images.length) {
        const images = el("div", "images");
        m.images.forEach(url => { const img = el("img"); img.src = url; img.alt = "image"; images.appendChild(img); });
        body.appendChild(images);
      }
      body.appendChild(el("div", "content plain", m.content));
    }
    node.appendChild(body);
    if (m.role === "assistant" && m.state !== "streaming") {
      const st = m.stats || {};
      const parts = [];
      if (st.tokens !== null && st.tokens !== undefined) parts.push(st.tokens + " tokens");
      if (st.tokens_per_s) parts.push(st.tokens_per_s.toFixed(1) + " tokens/s");
      if (st.ttft_ms !== null && st.ttft_ms !== undefined) parts.push("first token " + Math.round(st.ttft_ms) + " ms");
      if (m.finish_reason) parts.push("finish: " + m.finish_reason);
      node.appendChild(el("div", "stats", parts.join(" \u00b7 ")));
    }
    if (m.state !== "streaming") {
      const bar = el("div", "actions");
      bar.appendChild(button("copy", "copy", "copy this message", e => copy(m.content || "", e.target)));
      bar.appendChild(button("edit", "edit", m.role === "user" ? "edit and send again" : "edit this answer", () => edit(c, i, node)));
      if (m.role === "assistant" && i === c.messages.length - 1) bar.appendChild(button("regenerate", "regenerate", "answer again", () => regenerate(c, m)));
      if (m.role === "assistant" && m.trace) bar.appendChild(button("why-toggle", "why this token?", "show the tokens; click one to see its trace", () => showTokens(m, node)));
      node.appendChild(bar);
      const why = el("div", "why");
      why.hidden = true;
      node.appendChild(why);
    }
    return node;
  }

  function render() {
    const c = conv();
    const box = $("messages");
    const open = [...box.querySelectorAll(".msg")].filter(n => n.querySelector(".why") && !n.querySelector(".why").hidden)
      .map(n => +n.dataset.index);
    box.replaceChildren(...c.messages.map((_, i) => messageNode(c, i)));
    $("empty").hidden = c.messages.length > 0;
    open.forEach(i => {  // an open "why" view stays open across repaints
      const node = box.querySelector('.msg[data-index="' + i + '"]');
      if (node && c.messages[i] && c.messages[i].trace) showTokens(c.messages[i], node);
    });
    renderConversations();
    fillOptions();
    box.lastElementChild && box.lastElementChild.scrollIntoView({ block: "end" });
  }
  function renderConversations() {
    const list = $("conv-list");
    list.replaceChildren(...state.conversations.map(c => {
      const li = el("li", c.id === state.current ? "current" : null);
      li.dataset.id = c.id;
      const open = button("open", c.title || "New chat", null, () => {
        if (running) return;
        state.current = c.id; save(); render(); document.body.classList.remove("show-convs");
      });
      li.appendChild(open);
      li.appendChild(button("delete", "\u00d7", "delete this conversation", () => {
        if (running) return;
        state.conversations = state.conversations.filter(x => x !== c);
        if (!state.conversations.length) state.conversations.push(newConversation());
        if (state.current === c.id) state.current = state.conversations[0].id;
        save(); render();
      }));
      return li;
    }));
  }

  // ---- the options panel ------------------------------------------------------------------------------------
  const FIELDS = ["system", ...Client.NUMBERS, "stop", "structured", "structured_value", "tools", "tool_choice"];
  function fillOptions() {
    const o = conv().options;
    FIELDS.forEach(name => { $("opt-" + name).value = o[name] === undefined || o[name] === null ? "" : o[name]; });
    $("opt-trace").checked = !!o.trace;
    $("opt-parallel_tool_calls").checked = o.parallel_tool_calls !== false;
    $("opt-structured_value").hidden = !o.structured;
  }
  function readOption(name) {
    const o = conv().options;
    if (name === "trace" || name === "parallel_tool_calls") o[name] = $("opt-" + name).checked;
    else o[name] = $("opt-" + name).value;
    $("opt-structured_value").hidden = !o.structured;
    save();
  }
  function showOptionsError(message) {
    $("options-error").hidden = !message;
    $("options-error").textContent = message || "";
    if (message) document.body.classList.add("show-options");
  }

  // ---- wiring -----------------------------------------------------------------------------------------------
  function wire() {
    const input = $("input");
    $("composer").addEventListener("submit", e => {
      e.preventDefault();
      if (running) return;
      if (send(input.value)) input.value = "";
    });
    input.addEventListener("keydown", e => {  // Enter sends; Shift+Enter is a new line (the textarea's own)
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        $("composer").requestSubmit();
      }
    });
    document.addEventListener("keydown", e => { if (e.key === "Escape" && running) { e.preventDefault(); stop(); } });
    $("image-input").addEventListener("change", e => { attach(e.target.files); e.target.value = ""; });
    input.addEventListener("paste", e => {  // a pasted image is attached; pasted text goes into the box as usual
      const files = [...(e.clipboardData ? e.clipboardData.files : [])].filter(f => f.type.startsWith("image/"));
      if (!files.length) return;
      e.preventDefault();
      attach(files);
    });
    $("stop").addEventListener("click", stop);
    $("new-conv").addEventListener("click", () => {
      if (running) return;
      const c = newConversation(conv().options);
      state.conversations.unshift(c);
      state.current = c.id;
      save(); render();
      input.focus();
    });
    $("export").addEventListener("click", exportConversation);
    $("toggle-convs").addEventListener("click", () => { document.body.classList.toggle("show-convs"); document.body.classList.remove("show-options"); });
    $("toggle-options").addEventListener("click", () => { document.body.classList.toggle("show-options"); document.body.classList.remove("show-convs"); });
    FIELDS.forEach(name => $("opt-" + name).addEventListener(name === "structured" || name === "tool_choice" ? "change" : "input", () => readOption(name)));
    ["trace", "parallel_tool_calls"].forEach(name => $("opt-" + name).addEventListener("change", () => readOption(name)));
    $("messages").addEventListener("click", e => {
      if (e.target.classList.contains("copy-code")) copy(e.target.parentNode.querySelector("code").textContent, e.target);
    });
    $("key-form").addEventListener("submit", e => {
      e.preventDefault();
      const key = $("key-input").value.trim();
      if (!key) return;
      Client.setKey(key);
      $("key-input").value = "";
      $("key-dialog").hidden = true;
      const waiting = keyWaiters;
      keyWaiters = [];
      waiting.forEach(resolve => resolve());
    });
    $("forget-key").addEventListener("click", () => { Client.forgetKey(); $("forget-key").hidden = true; });
  }

  async function main() {
    Client.onKeyNeeded(askForKey);
    // A message left "streaming" by a reload was cut off: say so.
    state.conversations.forEach(c => c.messages.forEach(m => { if (m.state === "streaming") { m.state = "stopped"; m.finish_reason = "stopped"; } }));
    wire();
    render();
    setRunning(false);
    document.body.dataset.ready = "1";  // usable now; the model's name follows (after the key, if one is asked)
    try { await loadModel(); } catch (e) { $("model").textContent = "the server did not answer: " + e.message; }
    document.body.dataset.model = model || "";
    render();
  }
  main();
})();
