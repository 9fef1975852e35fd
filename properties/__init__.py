"""The Hypothesis layer: strategies that draw cases, and the property suite.

The engine (``gradequiv.harness``) decides a verdict for one case; this
package will choose the cases and shrink a failure to a minimal one.
"""
