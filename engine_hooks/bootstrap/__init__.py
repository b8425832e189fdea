"""The sitecustomize bootstrap lives here; this folder (not the package) goes on PYTHONPATH."""
