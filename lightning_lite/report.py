"""``python -m lightning_lite.report RUN_DIR``: the HTML report of a run (lightning_lite/extras/report.py)."""

from .extras.report import main

if __name__ == "__main__":
    main()
