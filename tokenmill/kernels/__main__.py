from tokenmill.kernels.build import main

raise SystemExit(main())
