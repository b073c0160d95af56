"""Side-by-side benchmark of django-agentruns against django-tasks-db and procrastinate.

Run it with `make bench` or `python -m bench [--quick] [--reps N]`; see bench/README.md.
"""
