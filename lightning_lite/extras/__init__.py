"""The optional features, one concern a file, each reaching the core through one narrow hook
(DESIGN.md: "The core and its extras"). A reader who follows one call from the proxy to a gradient
can skip this package."""
