// The chat page: conversations kept in this browser's localStorage, answers streamed from
// /v1/chat/completions. Model output is text: it reaches the page only through
// textContent or through renderMarkdown, which escapes it before adding its own tags.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = "ingot.conversations";
const SETTINGS = ["system", "temperature", "top_p", "max_tokens", "seed"];

const state = {
  key: localStorage.getItem("ingot.apiKey") || "",
  model: null,
  conversations: JSON.parse(localStorage.getItem(STORE) || "[]"),
  current: null,
  controller: null,
};

function save() {
  localStorage.setItem(STORE, JSON.stringify(state.conversations));
}

function setStatus(text) {
  $("status").textContent = text;
}

async function api(path, init = {}) {
  const headers = { "Content-Type": "application/json" };
  if (state.key) headers.Authorization = "Bearer " + state.key;
  return fetch(path, { ...init, headers });
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return body.error?.message || response.statusText;
  } catch {
    return response.status + " " + response.statusText;
  }
}

// ---- Markdown: escape first, then add tags; code is set as text. ----

function escapeHtml(s) {
  return s.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

// Inline markup of one escaped line: code spans are kept out of the other rules.
function inline(escaped) {
  return escaped
    .split(/(`[^`]+`)/)
    .map((part, i) => {
      if (i % 2 === 1) return "<code>" + part.slice(1, -1) + "</code>";
      return part
        .replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>")
        .replace(/(^|[^*\w])\*([^*\s][^*]*?)\*(?!\w)/g, "$1<em>$2</em>")
        .replace(/\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g, '<a href="$2" target="_blank" rel="noopener noreferrer">$1</a>');
    })
    .join("");
}

function element(tag, html) {
  const el = document.createElement(tag);
  el.innerHTML = html;
  return el;
}

function codeBlock(code, lang) {
  const pre = document.createElement("pre");
  const el = document.createElement("code");
  if (lang) el.dataset.lang = lang;
  el.textContent = code;
  const copy = document.createElement("button");
  copy.type = "button";
  copy.className = "copy";
  copy.textContent = "copy";
  copy.addEventListener("click", () => navigator.clipboard?.writeText(code));
  pre.append(copy, el);
  return pre;
}

function renderMarkdown(text) {
  const out = document.createDocumentFragment();
  const lines = text.split("\n");
  let paragraph = [];
  let list = null;
  const flush = () => {
    if (paragraph.length) out.append(element("p", paragraph.map((l) => inline(escapeHtml(l))).join("<br>")));
    paragraph = [];
    list = null;
  };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = line.match(/^\s*```\s*([\w+-]*)/);
    if (fence) {
      flush();
      const code = [];
      // An unclosed fence (an answer still streaming) runs to the end.
      while (++i < lines.length && !/^\s*```/.test(lines[i])) code.push(lines[i]);
      out.append(codeBlock(code.join("\n"), fence[1]));
      continue;
    }
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    const bullet = line.match(/^\s*[-*+]\s+(.*)$/);
    const numbered = line.match(/^\s*\d+[.)]\s+(.*)$/);
    const quote = line.match(/^>\s?(.*)$/);
    if (heading) {
      flush();
      out.append(element("h" + heading[1].length, inline(escapeHtml(heading[2]))));
    } else if (bullet || numbered) {
      const tag = bullet ? "UL" : "OL";
      if (paragraph.length) flush();
      if (!list || list.tagName !== tag) {
        list = document.createElement(tag);
        out.append(list);
      }
      list.append(element("li", inline(escapeHtml((bullet || numbered)[1]))));
    } else if (quote) {
      flush();
      out.append(element("blockquote", inline(escapeHtml(quote[1]))));
    } else if (line.trim() === "") {
      flush();
    } else {
      list = null;
      paragraph.push(line);
    }
  }
  flush();
  return out;
}

// ---- Messages ----

function messageView(role, text, meta) {
  const box = document.createElement("div");
  box.className = "message " + role;
  const label = document.createElement("div");
  label.className = "role";
  label.textContent = role;
  const body = document.createElement("div");
  body.className = "body";
  const info = document.createElement("div");
  info.className = "meta";
  box.append(label, body, info);
  const view = {
    box,
    set(text, meta) {
      if (role === "assistant") body.replaceChildren(renderMarkdown(text));
      else body.textContent = text;
      info.textContent = meta || "";
    },
  };
  view.set(text, meta);
  $("messages").append(box);
  box.scrollIntoView({ block: "end" });
  return view;
}

function showConversation() {
  $("messages").replaceChildren();
  for (const m of state.current?.messages || []) messageView(m.role, m.content, m.meta);
  renderList();
}

function renderList() {
  const items = state.conversations.map((c) => {
    const li = document.createElement("li");
    if (c === state.current) li.className = "current";
    const open = document.createElement("button");
    open.type = "button";
    open.className = "open";
    open.textContent = c.title;
    open.addEventListener("click", () => {
      state.current = c;
      showConversation();
    });
    const del = document.createElement("button");
    del.type = "button";
    del.className = "delete";
    del.title = "delete";
    del.textContent = "×";
    del.addEventListener("click", () => {
      state.conversations = state.conversations.filter((x) => x !== c);
      if (state.current === c) state.current = null;
      save();
      showConversation();
    });
    li.append(open, del);
    return li;
  });
  $("conversations").replaceChildren(...items);
}

function settings() {
  const number = (id) => ($(id).value === "" ? undefined : Number($(id).value));
  return {
    system: $("system").value.trim(),
    temperature: number("temperature"),
    top_p: number("top_p"),
    max_tokens: number("max_tokens"),
    seed: number("seed"),
  };
}

// Reads a server-sent event stream, calling onData with each `data:` payload.
async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (line.startsWith("data:")) onData(line.slice(5).trimStart());
      }
    }
  }
}

async function send(text) {
  if (!state.current) {
    state.current = { title: text.slice(0, 60), messages: [] };
    state.conversations.unshift(state.current);
  }
  const conversation = state.current;
  conversation.messages.push({ role: "user", content: text });
  save();
  renderList();
  messageView("user", text);

  const s = settings();
  const history = conversation.messages.map(({ role, content }) => ({ role, content }));
  const body = {
    model: state.model,
    messages: s.system ? [{ role: "system", content: s.system }, ...history] : history,
    stream: true,
    stream_options: { include_usage: true },
    temperature: s.temperature,
    top_p: s.top_p,
    max_tokens: s.max_tokens,
    seed: s.seed,
  };
  const view = messageView("assistant", "");
  let answer = "";
  let finish = null;
  let usage = null;
  let firstAt = null;
  const start = performance.now();
  state.controller = new AbortController();
  $("send").hidden = true;
  $("stop").hidden = false;
  // Redraws at most once a frame while tokens stream; the final draw (with the answer's
  // figures) is not overwritten by a frame still pending.
  let pending = false;
  let streaming = true;
  const redraw = () => {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => {
      pending = false;
      if (!streaming) return;
      view.set(answer);
      view.box.scrollIntoView({ block: "end" });
    });
  };
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST",
      body: JSON.stringify(body),
      signal: state.controller.signal,
    });
    if (response.status === 401) askForKey();
    if (!response.ok) throw new Error(await errorMessage(response));
    await readEvents(response, (data) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        if (choice.delta?.content) {
          firstAt ??= performance.now();
          answer += choice.delta.content;
          redraw();
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    });
    const seconds = (performance.now() - start) / 1000;
    const parts = [];
    if (usage) parts.push(`${usage.completion_tokens} tokens`, `${(usage.completion_tokens / seconds).toFixed(1)} tok/s`);
    if (firstAt) parts.push(`first token ${((firstAt - start) / 1000).toFixed(2)} s`);
    if (finish) parts.push(`finish: ${finish}`);
    const meta = parts.join(" · ");
    conversation.messages.push({ role: "assistant", content: answer, meta });
    view.set(answer, meta);
  } catch (e) {
    if (e.name === "AbortError") {
      conversation.messages.push({ role: "assistant", content: answer, meta: "stopped" });
      view.set(answer, "stopped");
    } else {
      view.box.classList.add("error");
      view.set(answer + (answer ? "\n\n" : "") + "Error: " + e.message);
      conversation.messages.pop();
    }
  } finally {
    streaming = false;
    state.controller = null;
    $("send").hidden = false;
    $("stop").hidden = true;
    save();
  }
}

function askForKey() {
  const dialog = $("key-dialog");
  if (!dialog.open) dialog.showModal();
}

async function loadModel() {
  let response;
  try {
    response = await api("/v1/models");
  } catch (e) {
    setStatus("server unreachable; retrying");
    setTimeout(loadModel, 2000);
    return;
  }
  if (response.status === 401) {
    setStatus("API key needed");
    askForKey();
    return;
  }
  if (!response.ok) {
    setStatus(await errorMessage(response));
    setTimeout(loadModel, 2000);
    return;
  }
  const model = (await response.json()).data[0];
  state.model = model.id;
  $("model").textContent = model.id;
  setStatus(`context ${model.max_model_len} tokens`);
}

function init() {
  for (const id of SETTINGS) {
    const saved = localStorage.getItem("ingot.setting." + id);
    if (saved !== null) $(id).value = saved;
    $(id).addEventListener("change", () => localStorage.setItem("ingot.setting." + id, $(id).value));
  }
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("input").value.trim();
    if (!text || state.controller || !state.model) return;
    $("input").value = "";
    send(text);
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => state.controller?.abort());
  $("new-chat").addEventListener("click", () => {
    state.current = null;
    showConversation();
    $("input").focus();
  });
  $("key-form").addEventListener("submit", () => {
    state.key = $("key").value;
    localStorage.setItem("ingot.apiKey", state.key);
    loadModel();
  });
  state.current = state.conversations[0] || null;
  showConversation();
  loadModel();
}

init();
