"""A sample Django project as docs/django.md builds it: a shop app whose orders send `order.created`
in their transaction, and a billing consumer using the ORM (tests/test_contrib_django_path.py)."""
