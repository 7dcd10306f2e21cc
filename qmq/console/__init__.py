"""`qmq console`: the web console (docs/operating.md). Server-rendered pages over the same client
calls as `qmq admin` (`qmq.client.admin`, rows from `qmq.admin.views`), served by Flask under
waitress.

One concern a module: `app` (the Flask application and its pages), `actions` (re-drive, purge and
reset: confirmed, logged, token-protected), `auth` (the token and the forms' CSRF check), `history`
(backlog and rates sampled over time), `chart` (inline SVG charts), `reports` (the last
reconciliation's report on disk), `server` (the `qmq console` process).
"""
