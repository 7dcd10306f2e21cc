"""The sample apps are run by tests, not collected as tests: eager_shop/ has a pytest run of its own
(tests/test_testing.py starts it)."""

collect_ignore = ["eager_shop"]
