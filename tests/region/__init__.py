"""Tests of the CPU region (a package so its conftest has a module name of its own)."""
