"""The prepared GPU check (gpu_check/README.md)."""
