"""The demo: both halves of superneurons on real data, with a report (``superneurons demo``)."""

from __future__ import annotations

from superneurons.demo.run import DemoConfig, run_demo

__all__ = ["DemoConfig", "run_demo"]
