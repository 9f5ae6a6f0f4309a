"""WSGI entry point: ``gunicorn -w 4 service.wsgi:app`` or ``waitress-serve service.wsgi:app``.

Rounds are closed by a separate ``pasto worker`` process in that setup.
"""

from service import create_app, freeze_startup_heap

app = create_app()
freeze_startup_heap()
