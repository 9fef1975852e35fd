"""The engine: one case down the full-storage and recompute paths, compared into a verdict.

``case`` and ``spread`` say what runs, ``runner`` runs one path and observes it,
``memory`` counts held bytes, ``compare`` turns pairs of tensors into metrics,
``verify`` decides the properties, ``localise`` finds the first diverging op.
"""
