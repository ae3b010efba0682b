module github.com/capsa-sandbox/capsa

go 1.26.0

require (
	github.com/mdlayher/vsock v1.4.0
	github.com/spf13/pflag v1.1.0
	golang.org/x/sys v0.49.0
)

require (
	github.com/mdlayher/socket v0.8.0 // indirect
	golang.org/x/net v0.62.0 // indirect
	golang.org/x/sync v0.24.0 // indirect
)
