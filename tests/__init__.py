from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
"""The repository root, for tests that run scripts, configs and assets from it."""
