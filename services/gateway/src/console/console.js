// Live pages: an element with data-live="<url>" follows that event stream; on each
// event the page is fetched again and its <main> swapped in, so what changed shows
// without a reload. Without scripts, nothing here runs and the page stays as loaded.
(function () {
  const live = document.querySelector('[data-live]');
  if (!live || !window.EventSource) return;
  const source = new EventSource(live.dataset.live);
  let pending = null;
  source.addEventListener('changed', function () {
    if (pending) return;
    pending = fetch(window.location.href, { credentials: 'same-origin' })
      .then(function (response) { return response.ok ? response.text() : null; })
      .then(function (html) {
        if (!html) return;
        const fresh = new DOMParser().parseFromString(html, 'text/html').querySelector('main');
        const current = document.querySelector('main');
        if (fresh && current) current.replaceWith(fresh);
      })
      .finally(function () { pending = null; });
  });
})();
