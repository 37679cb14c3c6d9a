"""Predictions against measurements: join harness records with the planner's answer for the
same request (this package imports both; the harness itself never imports the planner)."""
