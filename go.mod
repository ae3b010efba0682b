module github.com/capsa-sandbox/capsa

go 1.26.0

require github.com/spf13/pflag v1.1.0

require golang.org/x/sys v0.49.0 // indirect
