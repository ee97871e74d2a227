"""The command-line tools (``hybrid-ep demo | bench | tune | soak | prebuild``) and the rank
launcher that the tools and the tests use."""
