// Command colocate-fakegpu is a fake GPU driver for the devcluster's real node: a STAND-IN for NVIDIA's
// device plugin (k8s-device-plugin) with no GPU behind it. It speaks the kubelet's device plugin API
// (k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1): it offers --count healthy devices of --resource
// (nvidia.com/gpu) through ListAndWatch and answers Allocate with the environment NVIDIA's plugin gives a
// container (NVIDIA_VISIBLE_DEVICES, the allocated device IDs), so the kubelet, not a patch of the node's
// status, puts the GPUs into the node's capacity and allocatable and hands them to containers.
//
// It registers through the kubelet's plugin watcher (k8s.io/kubelet/pkg/apis/pluginregistration/v1): one
// unix socket in <kubelet root dir>/plugins_registry serves both the registration service (GetInfo says
// "a DevicePlugin for nvidia.com/gpu at this socket") and the device plugin service. The other way, a
// Register call to /var/lib/kubelet/device-plugins/kubelet.sock, is not used: the kubelet hard-codes that
// directory whatever its --root-dir and removes every socket in it when it starts, so two real nodes on one
// machine (two test runs) would take each other's plugins; the plugins_registry directory is each kubelet's.
//
// It prints one line per event on stderr (listening, registered, each ListAndWatch and Allocate) and, on
// SIGTERM or SIGINT, removes its socket (the kubelet then deregisters it) and exits 0.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	dp "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	reg "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// maxSocketPath is what a unix socket's path may hold on Linux (sun_path, 108 bytes with its NUL).
const maxSocketPath = 107

type plugin struct {
	dp.UnimplementedDevicePluginServer
	reg.UnimplementedRegistrationServer

	resource string
	devices  []*dp.Device
	envVar   string
	stop     chan struct{}

	mu         sync.Mutex
	registered bool
}

func newPlugin(resource string, count int, prefix, envVar string) *plugin {
	p := &plugin{resource: resource, envVar: envVar, stop: make(chan struct{})}
	for i := 0; i < count; i++ {
		p.devices = append(p.devices, &dp.Device{ID: fmt.Sprintf("%s%d", prefix, i), Health: dp.Healthy})
	}
	return p
}

// GetInfo: the plugin watcher's first call. An empty Endpoint means "this same socket".
func (p *plugin) GetInfo(context.Context, *reg.InfoRequest) (*reg.PluginInfo, error) {
	return &reg.PluginInfo{Type: reg.DevicePlugin, Name: p.resource, SupportedVersions: []string{dp.Version}}, nil
}

func (p *plugin) NotifyRegistrationStatus(_ context.Context, s *reg.RegistrationStatus) (*reg.RegistrationStatusResponse, error) {
	p.mu.Lock()
	p.registered = s.PluginRegistered
	p.mu.Unlock()
	if s.PluginRegistered {
		log.Printf("registered %s with the kubelet: %d devices", p.resource, len(p.devices))
	} else {
		log.Printf("the kubelet refused %s: %s", p.resource, s.Error)
	}
	return &reg.RegistrationStatusResponse{}, nil
}

func (p *plugin) GetDevicePluginOptions(context.Context, *dp.Empty) (*dp.DevicePluginOptions, error) {
	return &dp.DevicePluginOptions{}, nil
}

// ListAndWatch sends the devices once (they never change health) and holds the stream open until the
// kubelet goes or the plugin stops: a closed stream tells the kubelet the devices are gone.
func (p *plugin) ListAndWatch(_ *dp.Empty, stream grpc.ServerStreamingServer[dp.ListAndWatchResponse]) error {
	log.Printf("ListAndWatch: sending %d devices", len(p.devices))
	if err := stream.Send(&dp.ListAndWatchResponse{Devices: p.devices}); err != nil {
		return err
	}
	select {
	case <-stream.Context().Done():
	case <-p.stop:
	}
	return nil
}

func (p *plugin) known(id string) bool {
	for _, d := range p.devices {
		if d.ID == id {
			return true
		}
	}
	return false
}

// Allocate: for each container, the environment variable naming the devices it was given (as NVIDIA's
// plugin does with its default "envvar" strategy). No device node is mounted: there is none.
func (p *plugin) Allocate(_ context.Context, req *dp.AllocateRequest) (*dp.AllocateResponse, error) {
	resp := &dp.AllocateResponse{}
	for _, c := range req.ContainerRequests {
		for _, id := range c.DevicesIds {
			if !p.known(id) {
				return nil, status.Errorf(codes.InvalidArgument, "unknown device %q", id)
			}
		}
		ids := strings.Join(c.DevicesIds, ",")
		log.Printf("Allocate: %s=%s", p.envVar, ids)
		resp.ContainerResponses = append(resp.ContainerResponses, &dp.ContainerAllocateResponse{
			Envs: map[string]string{p.envVar: ids},
		})
	}
	return resp, nil
}

func (p *plugin) PreStartContainer(context.Context, *dp.PreStartContainerRequest) (*dp.PreStartContainerResponse, error) {
	return &dp.PreStartContainerResponse{}, nil
}

func main() {
	resource := flag.String("resource", "nvidia.com/gpu", "the extended resource the devices are offered as")
	count := flag.Int("count", 1, "how many fake devices")
	prefix := flag.String("id-prefix", "fake-gpu-", "device IDs are this prefix and 0..count-1")
	envVar := flag.String("env", "NVIDIA_VISIBLE_DEVICES", "Allocate sets this variable to the devices' IDs")
	registry := flag.String("registry-dir", "", "the kubelet's plugin registration directory (<root-dir>/plugins_registry)")
	flag.Parse()
	log.SetFlags(log.LstdFlags | log.Lmicroseconds)
	log.SetPrefix("colocate-fakegpu: ")
	if *registry == "" || *count < 0 {
		log.Fatal("need --registry-dir and --count >= 0")
	}
	socket := filepath.Join(*registry, strings.ReplaceAll(*resource, "/", "-")+".sock")
	if len(socket) > maxSocketPath {
		log.Fatalf("socket path %s is %d bytes, more than a unix socket may have (%d)", socket, len(socket), maxSocketPath)
	}
	if err := os.MkdirAll(*registry, 0o750); err != nil {
		log.Fatal(err)
	}
	if err := os.Remove(socket); err != nil && !errors.Is(err, os.ErrNotExist) {
		log.Fatal(err)
	}
	listener, err := net.Listen("unix", socket)
	if err != nil {
		log.Fatal(err)
	}
	p := newPlugin(*resource, *count, *prefix, *envVar)
	server := grpc.NewServer()
	reg.RegisterRegistrationServer(server, p)
	dp.RegisterDevicePluginServer(server, p)

	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		s := <-signals
		log.Printf("%s: removing %s", s, socket)
		close(p.stop)
		_ = os.Remove(socket)
		server.Stop()
	}()
	log.Printf("serving %d %s devices on %s", *count, *resource, socket)
	if err := server.Serve(listener); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		log.Fatal(err)
	}
}
