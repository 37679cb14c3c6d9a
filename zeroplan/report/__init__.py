"""Renderings of planner results: DataFrames, text tables, JSON and CSV."""
