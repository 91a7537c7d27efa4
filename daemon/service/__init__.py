"""The daemon's service: lifecycle, request handlers, sessions, admin, metrics."""
