// punchclock dashboard: forms sent in place, and the live stream applied
// to the page. Without this script every page still works (forms post and
// come back); with it, nothing reloads.
(function () {
  "use strict";
  var body = document.body;
  var flash = document.getElementById("flash");
  function say(text, bad) {
    if (!flash) return;
    flash.textContent = text;
    flash.className = bad ? "error" : "ok";
  }

  // Forms marked data-inplace post with fetch; the answer is a line of text.
  document.addEventListener("submit", function (ev) {
    var form = ev.target;
    if (!form.matches || !form.matches("form[data-inplace]")) return;
    ev.preventDefault();
    var data = new URLSearchParams(new FormData(form, ev.submitter));
    if (form.id === "bulk") {
      var picked = Array.prototype.map.call(document.querySelectorAll("input.pick:checked"), function (c) { return c.value; });
      data.set("tasks", picked.join(","));
    }
    fetch(form.action, { method: "POST", body: data, headers: { "x-punchclock-ui": "1" }, credentials: "same-origin" })
      .then(function (r) {
        return r.text().then(function (t) {
          say(t, !r.ok);
          if (r.ok && form.hasAttribute("data-reload")) setTimeout(function () { location.reload(); }, 400);
        });
      })
      .catch(function (e) { say("not sent: " + e, true); });
  });

  var all = document.getElementById("select-all");
  if (all) all.addEventListener("change", function () {
    document.querySelectorAll("input.pick").forEach(function (c) { c.checked = all.checked; });
  });

  // The live stream: run events put in place (cells, rows, a run's status).
  // A browser holds six HTTP/1.1 connections per host, and a page kept in
  // the back-forward cache keeps its stream: without closing it on
  // pagehide, the seventh page visited waits for ever. A tab hidden for a
  // minute lets its stream go too, and reads its page again when shown.
  var url = body.getAttribute("data-live-url");
  if (!url || !window.EventSource) return;
  var state = document.getElementById("live-state");
  function mark(s) { body.setAttribute("data-live", s); if (state) state.textContent = s === "open" ? "● live" : "○ " + s; }
  function swap(el, html) { var t = document.createElement("template"); t.innerHTML = html.trim(); el.replaceWith(t.content.firstChild); }
  function prepend(parent, html) { var t = document.createElement("template"); t.innerHTML = html.trim(); parent.insertBefore(t.content.firstChild, parent.firstChild); }
  function refresh() {
    fetch(location.href, { credentials: "same-origin" }).then(function (r) { return r.text(); }).then(function (html) {
      var doc = new DOMParser().parseFromString(html, "text/html");
      var main = doc.querySelector("main");
      if (main) document.querySelector("main").replaceWith(main);
    });
  }
  function onRun(ev) {
    var d = JSON.parse(ev.data);
    var cell = document.getElementById("cell-" + d.run_id);
    if (cell) swap(cell, d.cell);
    else {
      var strip = document.getElementById("slots-" + d.task_id);
      if (strip) {
        prepend(strip, d.cell);
        var max = +strip.getAttribute("data-max") || 20;
        while (strip.children.length > max) strip.removeChild(strip.lastElementChild);
      }
    }
    var row = document.getElementById("row-" + d.run_id);
    if (row) swap(row, d.row);
    else {
      var runs = document.getElementById("runs-" + d.task_id);
      if (runs && runs.getAttribute("data-head") === "1") prepend(runs, d.row);
    }
    // A run's own page: read it again for its attempts and result.
    if (document.getElementById("status-" + d.run_id)) refresh();
  }
  var es = null, idle = null;
  function open() {
    if (es) return;
    es = new EventSource(url);
    es.onopen = function () { mark("open"); };
    es.onerror = function () { mark("reconnecting"); };
    es.addEventListener("run", onRun);
    es.addEventListener("reload", function () { location.reload(); });
  }
  function close() { if (es) { es.close(); es = null; mark("paused"); } }
  window.addEventListener("pagehide", close);
  window.addEventListener("pageshow", function (ev) { if (ev.persisted) { refresh(); open(); } });
  document.addEventListener("visibilitychange", function () {
    if (document.visibilityState === "hidden") {
      idle = setTimeout(close, 60000);
    } else {
      clearTimeout(idle);
      if (!es) { refresh(); open(); }
    }
  });
  open();
})();
