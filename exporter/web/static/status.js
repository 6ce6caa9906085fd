"use strict";
(function () {
  var METHODS = ["is_sleeping", "is_scheduler_paused", "get_weight_version", "checkpoint_state"];
  var LABELS = {is_sleeping: "Sleep state", is_scheduler_paused: "Scheduler paused",
    get_weight_version: "Weight version", checkpoint_state: "Checkpoint"};
  var WORDS = {consistent: "CONSISTENT", inconsistent: "INCONSISTENT", unknown: "UNKNOWN"};
  var ICONS = {consistent: "\u2714", inconsistent: "\u2716", unknown: "?"};
  var SVG = "http://www.w3.org/2000/svg";
  var body = document.body;
  var refreshMs = parseInt(body.getAttribute("data-refresh-ms"), 10) || 5000;
  var lastOk = null;

  function el(tag, attrs, children) {
    var node = document.createElement(tag);
    var k;
    for (k in attrs || {}) { node.setAttribute(k, attrs[k]); }
    (children || []).forEach(function (c) {
      node.appendChild(typeof c === "string" ? document.createTextNode(c) : c);
    });
    return node;
  }
  function svg(tag, attrs) {
    var node = document.createElementNS(SVG, tag);
    var k;
    for (k in attrs) { node.setAttribute(k, attrs[k]); }
    return node;
  }
  function replace(id, nodes) {
    var target = document.getElementById(id);
    while (target.firstChild) { target.removeChild(target.firstChild); }
    nodes.forEach(function (n) { target.appendChild(n); });
  }
  function show(v) {
    if (v === null || v === undefined) { return "none"; }
    if (typeof v === "boolean") { return v ? "true" : "false"; }
    if (typeof v === "object") { return JSON.stringify(v); }
    return String(v);
  }
  function age(s) {
    if (s === null || s === undefined) { return "never"; }
    if (s < 10) { return s.toFixed(1) + " s"; }
    s = Math.floor(s);
    if (s < 120) { return s + " s"; }
    if (s < 7200) { return Math.floor(s / 60) + " min " + (s % 60) + " s"; }
    return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
  }
  function clock(unix) {
    if (!unix) { return "-"; }
    return new Date(unix * 1000).toISOString().substring(11, 19) + " UTC";
  }
  function stateOf(s) { return WORDS.hasOwnProperty(s) ? s : "unknown"; }

  function detail(method, v) {
    if (v.state === "consistent") {
      var text = show(v.value);
      if (method === "is_sleeping") { text += v.value ? " (asleep or paused)" : " (awake)"; }
      return text;
    }
    if (v.supported === false) { return "not asked in this attach mode"; }
    if (v.state === "inconsistent" && v.by_engine) {
      return Object.keys(v.by_engine).map(function (e) {
        return "engine " + e + ": " + show(v.by_engine[e]);
      }).join(" \u00b7 ");
    }
    if (v.missing && v.missing.length) { return "no answer from engine " + v.missing.join(", "); }
    return v.error || "no poll yet";
  }
  function banners(doc) {
    return Object.keys(doc.aggregate).map(function (m) {
      var v = doc.aggregate[m];
      var st = stateOf(v.state);
      return el("div", {"class": "banner st-" + st, id: "v-" + m, "data-state": st, role: "status"}, [
        el("span", {"class": "icon", "aria-hidden": "true"}, [ICONS[st]]), " ",
        el("span", {"class": "label"}, [LABELS[m] || m]), " ", el("code", {}, [m]), " ",
        el("strong", {"class": "word"}, [WORDS[st]]), " ",
        el("span", {"class": "detail"}, [detail(m, v)])]);
    });
  }
  function known(v) { return v !== null && v !== undefined; }
  function elasticLine(o) {
    if (!known(o.phase)) { return [String(o.problem || "not read yet"), "unknown"]; }
    var words = [o.phase === "other" ? "other (" + o.reported_phase + ")" : String(o.phase)];
    if (o.scaling) { words.push("serving paused"); }
    if (known(o.requested_data_parallel_size)) {
      words.push("to DP size " + o.requested_data_parallel_size);
    }
    if (known(o.epoch)) { words.push("epoch " + o.epoch); }
    if (o.error) { words.push("error: " + o.error); }
    return [words.join(", "), String(o.phase)];
  }
  function elastic(doc) {
    var ops = doc.elastic_ep_operations || [];
    var shown = ops.some(function (o) {
      return known(o.phase) ? o.phase !== "idle" : (o.supported !== false && !!o.problem);
    });
    document.getElementById("elastic-section").hidden = !shown;
    return shown ? ops.map(function (o) {
      var line = elasticLine(o);
      return el("li", {"class": "ee-" + line[1], "data-target": String(o.target)},
        [el("strong", {}, [String(o.target)]), ": " + line[0]]);
    }) : [];
  }
  function cell(i) {
    if (!i || i.outcome === null || i.outcome === undefined) { return ["-", false]; }
    if (i.outcome === "ok") { return [show(i.value), false]; }
    return [String(i.outcome), i.outcome !== "unsupported"];
  }
  function ftCell(ft) {
    if (!ft) { return ["-", false]; }
    var status = String(ft.status);
    return [ft.fault_info ? status + " (" + ft.fault_info + ")" : status, status !== "healthy"];
  }
  function activityCell(a) {
    a = a || {};
    var drained = a.drained;
    var kind = (drained === null || drained === undefined) ? "unknown" :
      (drained ? "drained" : "busy");
    var word = {busy: "has work", drained: "drained", unknown: "unknown"}[kind];
    var counts = ["running", "waiting"].filter(function (k) {
      return a[k] !== null && a[k] !== undefined;
    }).map(function (k) { return k + " " + a[k]; });
    return [counts.length ? word + " (" + counts.join(", ") + ")" : word, kind];
  }
  function engineRow(e) {
    var up = !!e.up;
    var cells = [el("td", {}, [String(e.engine)]),
      el("td", {"class": "up"}, [(up ? "up" : "DOWN") + (e.connected ? "" : " (disconnected)")]),
      el("td", {}, [String(e.state)]), el("td", {}, [age(e.seconds_since_last_success)])];
    var error = "";
    METHODS.forEach(function (m) {
      var i = (e.invariants || {})[m] || {};
      var c = cell(i);
      cells.push(el("td", c[1] ? {"class": "bad"} : {}, [c[0]]));
      error = error || i.error || "";
    });
    let version = String(e.vllm_version || "-");
    if (e.front_end === "rust") version += ` (Rust front end ${e.rust_frontend_version || "?"})`;
    cells.push(el("td", {}, [version]));
    var ft = ftCell(e.fault_tolerance);
    cells.push(el("td", {"class": "ft" + (ft[1] ? " bad" : "")}, [ft[0]]));
    var act = activityCell(e.activity);
    cells.push(el("td", {"class": "act act-" + act[1], "data-activity": act[1]}, [act[0]]));
    cells.push(el("td", {"class": "err"}, [String(error)]));
    var attrs = {"data-engine": String(e.engine), "data-up": up ? "true" : "false"};
    if (!up) { attrs["class"] = "down"; }
    return el("tr", attrs, cells);
  }
  function lastAction(a, now) {
    if (!a) { return [el("p", {"class": "muted"}, ["No admin action since start."])]; }
    var params = Object.keys(a.params || {}).map(function (k) {
      return k + "=" + show(a.params[k]);
    }).join(", ");
    var head = el("p", {}, [el("strong", {}, [String(a.action)]), " \u2014 ",
      el("strong", {"class": "outcome"}, [String(a.outcome).toUpperCase()]),
      " (HTTP " + a.status + ") at " + clock(a.unix) + ", " + age(now - a.unix) + " ago" +
      (params ? "; " + params : "") + (a.error ? "; " + a.error : "")]);
    if (!a.engines.length) { return [head]; }
    var rows = a.engines.map(function (x) {
      return el("tr", {"data-engine": String(x.engine)}, [el("td", {}, [String(x.engine)]),
        el("td", x.ok ? {} : {"class": "bad"}, [x.ok ? "ok" : "FAILED"]),
        el("td", {}, [String(x.reason || "-")]), el("td", {"class": "err"}, [String(x.error || "")])]);
    });
    var head2 = el("tr", {}, ["engine", "result", "reason", "error"].map(function (h) {
      return el("th", {}, [h]);
    }));
    return [head, el("table", {id: "action-engines"}, [el("thead", {}, [head2]),
      el("tbody", {}, rows)])];
  }
  function pairs(d) {
    var keys = Object.keys(d || {});
    return keys.length ? keys.map(function (k) { return k + " " + d[k]; }).join(" \u00b7 ") : "none";
  }
  function counters(c) {
    var actions = Object.keys(c.actions).map(function (n) { return n + ": " + pairs(c.actions[n]); });
    var items = [["since", clock(c.since_unix)], ["polls", String(c.polls)],
      ["inconsistencies", pairs(c.inconsistencies)],
      ["failed calls", c.failed_calls_total + " (" + pairs(c.failed_calls) + ")"],
      ["admin actions", pairs(c.actions_by_outcome)],
      ["by action", actions.length ? actions.join(" \u00b7 ") : "none"]];
    var dl = el("dl", {"class": "counters"});
    items.forEach(function (it) {
      dl.appendChild(el("dt", {}, [it[0]]));
      dl.appendChild(el("dd", {}, [it[1]]));
    });
    return [dl];
  }
  function timeline(h, now) {
    var width = h.bucket_s || 1;
    var slots = Math.round(h.window_s / width) || 1;
    var current = Math.floor(now / width);
    var rows = METHODS.map(function (m) { return [m, []]; });
    var upRow = [];
    h.entries.forEach(function (e) {
      var x = slots - 1 - (current - Math.floor(e.start_unix / width));
      if (x < 0 || x >= slots) { return; }
      var span = clock(e.start_unix) + "\u2013" + clock(e.end_unix);
      rows.forEach(function (r) {
        var st = e.states[r[0]];
        if (WORDS.hasOwnProperty(st)) {
          r[1].push([x, st, span + ": " + r[0] + " " + st + " (" + e.polls + " polls)"]);
        }
      });
      var up = e.engines_up_min, exp = e.engines_expected;
      var st = up >= exp ? "consistent" : (up === 0 ? "inconsistent" : "unknown");
      upRow.push([x, st, span + ": at least " + up + "/" + exp + " engines up"]);
    });
    rows.push(["engines up", upRow]);
    var grid = el("div", {"class": "timeline"});
    rows.forEach(function (r) {
      grid.appendChild(el("span", {"class": "tl-label"}, [r[0]]));
      var bar = svg("svg", {"class": "tl-bar", viewBox: "0 0 " + slots + " 1",
        preserveAspectRatio: "none", role: "img", "aria-label": r[0] + " over the last hour"});
      r[1].forEach(function (c) {
        var rect = svg("rect", {"class": "st-" + c[1], x: c[0], y: 0, width: 1, height: 1});
        var title = svg("title", {});
        title.textContent = c[2];
        rect.appendChild(title);
        bar.appendChild(rect);
      });
      grid.appendChild(bar);
    });
    grid.appendChild(el("span"));
    grid.appendChild(el("div", {"class": "tl-axis"}, [el("span", {}, ["-60 min"]),
      el("span", {}, ["now"])]));
    return [grid];
  }
  function summary(doc) {
    var up = doc.engines.filter(function (e) { return e.up; }).length;
    var p = doc.last_poll;
    return "engines up " + up + "/" + doc.engines_expected + " \u00b7 connected " +
      doc.engines_connected + "/" + doc.engines_expected + " \u00b7 " + doc.attach +
      " mode \u00b7 poll #" + p.number + " at " + clock(p.unix);
  }
  function render(doc) {
    var now = doc.generated_unix;
    document.getElementById("summary").textContent = summary(doc);
    replace("banners", banners(doc));
    replace("elastic-ep", elastic(doc));
    replace("engine-rows", doc.engines.map(engineRow));
    replace("last-action", lastAction(doc.last_action, now));
    replace("counters", counters(doc.counters));
    replace("timeline", timeline(doc.history, now));
  }
  function stale(message) {
    var conn = document.getElementById("conn");
    conn.textContent = "status unavailable (" + message + "); showing data from " +
      (lastOk ? new Date(lastOk).toISOString().substring(11, 19) + " UTC" : "the page load");
    conn.hidden = false;
  }
  function refresh() {
    if (document.hidden) { return; }
    fetch("status", {cache: "no-store", headers: {Accept: "application/json"}})
      .then(function (r) {
        if (!r.ok) { throw new Error("HTTP " + r.status); }
        return r.json();
      })
      .then(function (doc) {
        render(doc);
        lastOk = Date.now();
        document.getElementById("conn").hidden = true;
        body.setAttribute("data-live", String(parseInt(body.getAttribute("data-live"), 10) + 1));
      })
      .catch(function (err) { stale(err && err.message ? err.message : String(err)); });
  }
  refresh();
  setInterval(refresh, refreshMs);
  document.addEventListener("visibilitychange", refresh);
})();
