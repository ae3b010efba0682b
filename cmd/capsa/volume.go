package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"strings"
	"text/tabwriter"

	"github.com/capsa-sandbox/capsa/supervisor"
	"github.com/capsa-sandbox/capsa/volume"
)

func runVolume(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return runVerbs(ctx, "volume", map[string]func(context.Context, []string, io.Writer, io.Writer) int{
		"create": volumeCreate, "ls": volumeList, "inspect": volumeInspect, "rm": volumeRemove,
	}, args, stdout, stderr)
}

// volumeRow is what ls and inspect show of a volume: its description and
// the detached sandboxes running with it mounted.
type volumeRow struct {
	*volume.Info
	UsedBy []string `json:"used_by"`
}

// volumeCreate: capsa volume create NAME [--size SIZE].
func volumeCreate(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("volume create", "[flags] NAME", stdout)
	size := fs.String("size", "", "the quota: the most the volume may take, e.g. 10M or 2G (default: no quota)")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if fs.NArg() != 1 {
		fmt.Fprintln(stderr, "capsa volume create: want NAME")
		return 2
	}
	var quota uint64
	if fs.Changed("size") {
		var err error
		if quota, err = parseSize(*size); err != nil {
			fmt.Fprintf(stderr, "capsa volume create: --size: %v\n", err)
			return 2
		}
	}
	name := fs.Arg(0)
	if err := volume.CheckName(name); err != nil {
		fmt.Fprintf(stderr, "capsa volume create: %v\n", err)
		return 2
	}
	r, err := volume.Open("")
	if err == nil {
		_, err = r.Create(name, int64(quota))
	}
	if err != nil {
		fmt.Fprintf(stderr, "capsa volume create: %v\n", err)
		return 1
	}
	fmt.Fprintln(stdout, name)
	return 0
}

func volumeList(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("volume ls", "[flags]", stdout)
	format := fs.String("format", "table", "table or json")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if fs.NArg() != 0 {
		fmt.Fprintf(stderr, "capsa volume ls: unexpected argument %q\n", fs.Arg(0))
		return 2
	}
	r, err := volume.Open("")
	var infos []*volume.Info
	if err == nil {
		infos, err = r.List()
	}
	if err != nil {
		fmt.Fprintf(stderr, "capsa volume ls: %v\n", err)
		return 1
	}
	rows := volumeRows(r, infos)
	if *format == "json" {
		writeJSON(stdout, rows)
		return 0
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tSIZE\tUSED\tIN USE BY")
	for _, v := range rows {
		quota := "-"
		if v.Quota > 0 {
			quota = humanBytes(uint64(v.Quota))
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", v.Name, quota, humanBytes(uint64(v.Used)), usersText(v))
	}
	tw.Flush()
	return 0
}

func volumeInspect(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("volume inspect", "NAME...", stdout)
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if fs.NArg() == 0 {
		fmt.Fprintln(stderr, "capsa volume inspect: want NAME...")
		return 2
	}
	r, err := volume.Open("")
	if err != nil {
		fmt.Fprintf(stderr, "capsa volume inspect: %v\n", err)
		return 1
	}
	code := 0
	var infos []*volume.Info
	for _, name := range fs.Args() {
		info, err := r.Get(name)
		if err != nil {
			fmt.Fprintf(stderr, "capsa volume inspect: %v\n", err)
			code = 1
			continue
		}
		infos = append(infos, info)
	}
	if len(infos) > 0 {
		writeJSON(stdout, volumeRows(r, infos))
	}
	return code
}

func volumeRemove(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("volume rm", "[flags] NAME...", stdout)
	force := fs.BoolP("force", "f", false, "remove a volume even while sandboxes have it mounted (they keep what they have open)")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if fs.NArg() == 0 {
		fmt.Fprintln(stderr, "capsa volume rm: want NAME...")
		return 2
	}
	r, err := volume.Open("")
	if err != nil {
		fmt.Fprintf(stderr, "capsa volume rm: %v\n", err)
		return 1
	}
	code := 0
	for _, name := range fs.Args() {
		err := r.Remove(name, *force)
		if errors.Is(err, volume.ErrInUse) {
			err = fmt.Errorf("volume %s is in use by %s: stop them first, or volume rm --force", name, usersText(volumeRows(r, []*volume.Info{{Name: name, InUse: true}})[0]))
		}
		if err != nil {
			fmt.Fprintf(stderr, "capsa volume rm: %v\n", err)
			code = 1
			continue
		}
		fmt.Fprintln(stdout, name)
	}
	return code
}

// volumeRows adds to each volume in use the detached sandboxes that run
// with it mounted (when the store can say).
func volumeRows(r *volume.Root, infos []*volume.Info) []volumeRow {
	rows := make([]volumeRow, len(infos))
	var recs []*supervisor.Record
	for _, v := range infos {
		if v.InUse {
			if m, err := openManager(); err == nil {
				recs, _ = m.List()
			}
			break
		}
	}
	for i, v := range infos {
		rows[i] = volumeRow{Info: v, UsedBy: []string{}}
		if !v.InUse {
			continue
		}
		for _, rec := range recs {
			if rec.Alive() && mounts(rec, r.Dir(), v.Name) {
				rows[i].UsedBy = append(rows[i].UsedBy, rec.Name)
			}
		}
	}
	return rows
}

// mounts reports whether the sandbox rec mounts the volume name of the
// volumes directory dir.
func mounts(rec *supervisor.Record, dir, name string) bool {
	for _, v := range rec.Spec.Volumes {
		vd := v.Dir
		if vd == "" {
			vd, _ = volume.DefaultDir()
		}
		if abs, err := filepath.Abs(vd); err == nil && v.Name == name && abs == dir {
			return true
		}
	}
	return false
}

// usersText says who has a volume mounted, for ls and rm.
func usersText(v volumeRow) string {
	switch {
	case len(v.UsedBy) > 0:
		return strings.Join(v.UsedBy, ", ")
	case v.InUse:
		return "a sandbox that capsa ps does not list"
	}
	return "-"
}
