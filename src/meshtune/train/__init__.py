"""The training loop, its optimizer schedule and its metrics."""
