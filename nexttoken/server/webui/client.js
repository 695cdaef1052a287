// The chat page's API client: the key, requests built from a conversation and its options, and the server-sent
// events of a streamed answer. Only public endpoints; nothing here touches the page (app.js does).
"use strict";
const Client = (function () {
  const KEY = "nexttoken.webui.apiKey";  // localStorage: the API key, when the server asks for one
  const NUMBERS = ["temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "presence_penalty",
    "frequency_penalty", "repetition_penalty"];
  const INTEGERS = new Set(["top_k", "max_tokens", "seed"]);
  let askForKey = async () => { throw new Error("this server asks for an API key"); };

  const key = () => localStorage.getItem(KEY);
  function headers(json) {
    const h = {};
    if (json) h["Content-Type"] = "application/json";
    if (key()) h["Authorization"] = "Bearer " + key();
    return h;
  }

  /** The API's own error body of a failed response, as one line. */
  async function errorOf(response) {
    try {
      const body = await response.json();
      if (body && body.error) return body.error.message + (body.error.param ? " (" + body.error.param + ")" : "");
    } catch (e) { /* not JSON */ }
    return "HTTP " + response.status;
  }

  /** fetch with the key; a 401 asks for the key (the page's dialog) and tries again. */
  async function api(path, init) {
    for (;;) {
      const response = await fetch(path, { ...init, headers: headers(init && init.body) });
      if (response.status !== 401) return response;
      const message = await errorOf(response);
      await askForKey(key() ? "the server refused this key: " + message : null);
    }
  }

  /** The body of a chat request: the conversation's messages before `upto`, its options, the served model. */
  function requestBody(c, upto, model) {
    const o = c.options, body = { model, stream: true, stream_options: { include_usage: true } };
    const messages = [];
    if (o.system && o.system.trim()) messages.push({ role: "system", content: o.system });
    c.messages.slice(0, upto).forEach(m => {
      if (m.role === "assistant" && m.state === "error" && !m.content) return;  // a failed answer said nothing
      const out = { role: m.role, content: m.content || "" };
      if (m.images && m.images.length) {  // the images first, as data: URLs, then the text (OpenAI's image_url parts)
        out.content = m.images.map(url => ({ type: "image_url", image_url: { url } }));
        if (m.content) out.content.push({ type: "text", text: m.content });
      }
      if (m.tool_calls && m.tool_calls.length) out.tool_calls = m.tool_calls;
      messages.push(out);
    });
    body.messages = messages;
    NUMBERS.forEach(name => {  // a blank field is left out: the server's default applies
      const v = o[name];
      if (v === undefined || v === null || v === "") return;
      const n = Number(v);
      if (!Number.isFinite(n) || (INTEGERS.has(name) && !Number.isInteger(n))) {
        throw new Error(name + " must be " + (INTEGERS.has(name) ? "an integer" : "a number") + ", got " + JSON.stringify(v));
      }
      body[name] = n;
    });
    const stops = (o.stop || "").split("\n").filter(s => s !== "");
    if (stops.length) body.stop = stops;
    const sv = o.structured_value || "";
    if (o.structured === "json_schema") {
      let schema;
      try { schema = JSON.parse(sv); } catch (e) { throw new Error("the JSON Schema is not valid JSON: " + e.message); }
      body.response_format = { type: "json_schema", json_schema: { name: "answer", schema } };
    } else if (o.structured === "regex") {
      body.structured_outputs = { regex: sv };
    } else if (o.structured === "choice") {
      body.structured_outputs = { choice: sv.split("\n").filter(s => s !== "") };
    }
    if (o.tools && o.tools.trim()) {
      try { body.tools = JSON.parse(o.tools); } catch (e) { throw new Error("tools is not valid JSON: " + e.message); }
      if (o.tool_choice) body.tool_choice = o.tool_choice;
      if (o.parallel_tool_calls === false) body.parallel_tool_calls = false;
    }
    if (o.trace) body.trace = true;
    return body;
  }

  /** The chunks of a streamed response, parsed, until [DONE]; an error event, or an end before [DONE], throws. */
  async function* events(response) {
    const reader = response.body.getReader(), decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) throw new Error("the connection closed before the answer ended");
      buffer += decoder.decode(value, { stream: true });  // this server ends its lines with \n
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {  // one event per blank line
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = event.split("\n").filter(l => l.startsWith("data:")).map(l => l.slice(5).trimStart()).join("\n");
        if (!data) continue;
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        yield chunk;
      }
    }
  }

  return { NUMBERS, key, setKey: k => localStorage.setItem(KEY, k), forgetKey: () => localStorage.removeItem(KEY),
    onKeyNeeded: fn => { askForKey = fn; }, errorOf, api, requestBody, events };
})();
