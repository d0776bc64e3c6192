"""Canary comparison between engines: splits, shadow copies, output agreement, the verdict."""
