"""Tools that use both services and belong to neither: the conformance kit (`planserve
conformance`) and the offline `LLM` (`from planserve import LLM`).
"""
