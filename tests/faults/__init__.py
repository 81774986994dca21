"""Fault tests (issue 8 rows): each fault against a naive control and against jobfence."""
