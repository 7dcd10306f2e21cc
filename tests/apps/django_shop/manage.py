"""`python tests/apps/django_shop/manage.py migrate`, as in any Django project."""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.apps.django_shop.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
