"""Measurements behind `bullet profile` (these modules import torch)."""
