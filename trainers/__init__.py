"""Trainer side of weight_sync: weight sources, LoRA merge, name mapping, RL loop glue, Ray actors.

This package imports weight_sync; weight_sync never imports it.
"""
