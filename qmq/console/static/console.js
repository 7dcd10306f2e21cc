// qmq console: the live part of a page (#live) is fetched again every few seconds, so figures and
// charts follow the cluster without a reload. Nothing else runs; every page works without it.
(function () {
  const seconds = parseFloat(document.body.dataset.refresh || "0");
  if (!(seconds > 0)) return;
  async function refresh() {
    const live = document.getElementById("live");
    if (!live || document.hidden) return;
    try {
      const reply = await fetch(window.location.href, { headers: { "X-Refresh": "1" }, credentials: "same-origin" });
      if (!reply.ok) return;
      const page = new DOMParser().parseFromString(await reply.text(), "text/html");
      const fresh = page.getElementById("live");
      if (!fresh) return;
      // what the reader opened stays open
      const opened = Array.from(live.querySelectorAll("details")).map((d) => d.open);
      fresh.querySelectorAll("details").forEach((d, i) => { if (i < opened.length) d.open = opened[i]; });
      live.replaceWith(fresh);
    } catch (e) {
      // the console is restarting or the network is away: try again next time
    }
  }
  setInterval(refresh, seconds * 1000);
})();
