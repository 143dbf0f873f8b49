from nbl_gguf.cli import main

raise SystemExit(main())
