# On PYTHONPATH for the suite's launches (conftest.py): a generated project's
# requirements.txt has no matplotlib, and its runs are tested as a fresh install runs.
raise ModuleNotFoundError("no matplotlib (the suite's launches)", name="matplotlib")
