// A small Markdown renderer that builds DOM nodes: model text only ever becomes text nodes (textContent), never
// markup, so nothing a model writes can run. Blocks: fenced code (an unclosed fence while streaming is still
// code), headings, lists, quotes, rules, paragraphs (a single newline is a line break, as chat text means it).
// Inline: `code`, **bold**, *italic* / _italic_, and [links](https://...) to http(s) addresses only.
"use strict";
(function () {
  const el = (tag, cls, text) => {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  };

  // One combined pattern, tried left to right: code first (its content is literal), then links, bold, italics.
  const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\)|\*\*(?=\S)([\s\S]*?\S)\*\*|\*(?=[^\s*])([^*\n]*?[^\s*])\*|\b_(?=\S)([^_\n]*?\S)_\b/g;

  function inline(text, parent) {
    const re = new RegExp(INLINE.source, "g");  // its own: the calls nest (bold inside a link's text, ...)
    let last = 0;
    for (let m; (m = re.exec(text)) !== null;) {
      if (m.index > last) parent.appendChild(document.createTextNode(text.slice(last, m.index)));
      if (m[1] !== undefined) parent.appendChild(el("code", null, m[2]));
      else if (m[3] !== undefined) {
        const a = el("a", null, m[3]);
        a.href = m[4];  // only http(s) addresses match the pattern: no javascript: links
        a.rel = "noopener noreferrer nofollow";
        a.target = "_blank";
        parent.appendChild(a);
      } else if (m[5] !== undefined) inline(m[5], parent.appendChild(el("strong")));
      else if (m[6] !== undefined) inline(m[6], parent.appendChild(el("em")));
      else inline(m[7], parent.appendChild(el("em")));
      last = re.lastIndex;
    }
    if (last < text.length) parent.appendChild(document.createTextNode(text.slice(last)));
    return parent;
  }

  function lines(parent, texts) {  // a paragraph's lines, with line breaks between them
    texts.forEach((t, i) => {
      if (i) parent.appendChild(el("br"));
      inline(t, parent);
    });
    return parent;
  }

  const FENCE = /^\s{0,3}(```+|~~~+)\s*([\w+#.-]*)\s*$/;
  const HEADING = /^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
  const BULLET = /^\s{0,3}[-*+]\s+(.*)$/;
  const NUMBERED = /^\s{0,3}(\d{1,9})[.)]\s+(.*)$/;
  const QUOTE = /^\s{0,3}>\s?(.*)$/;
  const RULE = /^\s{0,3}([-*_])(\s*\1){2,}\s*$/;

  /** The Markdown text as a DocumentFragment of safe nodes. */
  function render(text) {
    const out = document.createDocumentFragment();
    const src = String(text).replace(/\r\n?/g, "\n").split("\n");
    let i = 0;
    while (i < src.length) {
      const line = src[i];
      let m;
      if ((m = FENCE.exec(line))) {  // code: kept verbatim until the closing fence (or the end, while streaming)
        const body = [];
        i++;
        while (i < src.length && !(src[i].trim().startsWith(m[1]) && src[i].trim().replace(/[`~]/g, "") === "")) body.push(src[i++]);
        i++;
        const pre = el("pre", "code");
        if (m[2]) pre.dataset.lang = m[2];
        const code = el("code", m[2] ? "language-" + m[2] : null, body.join("\n"));
        pre.appendChild(code);
        const copy = el("button", "copy-code", "copy");
        copy.type = "button";
        pre.appendChild(copy);
        out.appendChild(pre);
      } else if (line.trim() === "") {
        i++;
      } else if ((m = HEADING.exec(line))) {
        out.appendChild(inline(m[2], el("h" + Math.min(6, m[1].length + 2))));  // #: h3, the page owns h1 and h2
        i++;
      } else if (RULE.test(line)) {
        out.appendChild(el("hr"));
        i++;
      } else if (BULLET.test(line) || NUMBERED.test(line)) {
        const ordered = !BULLET.test(line);
        const list = el(ordered ? "ol" : "ul");
        if (ordered) list.start = +NUMBERED.exec(line)[1];
        while (i < src.length && (ordered ? NUMBERED : BULLET).test(src[i])) {
          const item = (ordered ? NUMBERED : BULLET).exec(src[i]);
          list.appendChild(inline(ordered ? item[2] : item[1], el("li")));
          i++;
        }
        out.appendChild(list);
      } else if (QUOTE.test(line)) {
        const body = [];
        while (i < src.length && QUOTE.test(src[i])) body.push(QUOTE.exec(src[i++])[1]);
        out.appendChild(lines(el("blockquote"), body));
      } else {
        const body = [];
        while (i < src.length && src[i].trim() !== "" && !FENCE.test(src[i]) && !HEADING.test(src[i]) &&
               !BULLET.test(src[i]) && !NUMBERED.test(src[i]) && !QUOTE.test(src[i]) && !RULE.test(src[i])) body.push(src[i++]);
        out.appendChild(lines(el("p"), body));
      }
    }
    return out;
  }

  window.Markdown = { render };
})();
