"""kvtier package."""
